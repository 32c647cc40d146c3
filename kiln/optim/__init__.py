"""`kiln.optim`: optimizers as pure functions of pytrees (optax's shape, torch's math).

    >>> from kiln import optim
    >>> opt = optim.AdamW(lr=1e-3)
    >>> state = opt.init(params)
    >>> params, state = opt.update(grads, state, params)   # traces into kn.compile
    >>> opt.step(model, grads)                             # or eagerly, in place

See docs/nn.md for a compiled training step.
"""

from kiln.optim.adam import Adam, AdamW  # noqa: F401
from kiln.optim.clip import clip_grad_norm, global_norm  # noqa: F401
from kiln.optim.optimizer import Optimizer  # noqa: F401
from kiln.optim.sgd import SGD  # noqa: F401
