"""`kiln.optim`: optimizers as pure functions of pytrees (optax's shape, torch's math).

    >>> from kiln import optim
    >>> opt = optim.AdamW(lr=1e-3)
    >>> state = opt.init(params)
    >>> params, state = opt.update(grads, state, params)   # traces into kn.compile
    >>> opt.step(model, grads)                             # or eagerly, in place

PyTorch's stateful form works too: `optim.AdamW(model.parameters(), lr=1e-3)` (or
parameter-group dicts), then `loss.backward(); opt.step(); opt.zero_grad()`, with the
schedulers of `optim.lr_scheduler`. See docs/nn.md and docs/porting-from-pytorch.md.
"""

from kiln.optim.adam import Adam, AdamW  # noqa: F401
from kiln.optim.clip import clip_grad_norm, global_norm  # noqa: F401
from kiln.optim.optimizer import Optimizer  # noqa: F401
from kiln.optim.sgd import SGD  # noqa: F401
from kiln.optim import lr_scheduler  # noqa: F401,E402
