"""
A nanoGPT-style training run (the loop of Karpathy's train.py: warmup + cosine learning
rate, AdamW with decay/no-decay groups, gradient clipping, periodic evaluation under
no_grad, then sampling), on a tiny character-level dataset built in memory.

Written for PyTorch; ported to kiln by changing the import lines marked "was:" only.
tests/test_examples_nanogpt.py runs it and the torch original side by side.

    .venv/bin/python examples/nanogpt/train.py [--max_iters 200] [--compile]
"""

import argparse
import math
import os
import sys
import time

import numpy as np

import kiln as torch  # was: import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import GPTConfig, GPT  # noqa: E402

TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "First Citizen: You are all resolved rather to die than to famish? All: Resolved. "
        "resolved. First Citizen: First, you know Caius Marcius is chief enemy to the people. ")

# -----------------------------------------------------------------------------
# default config values, a tiny shakespeare_char
batch_size = 8
block_size = 32
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.0
bias = False
learning_rate = 3e-3
max_iters = 60
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0
decay_lr = True
warmup_iters = 10
lr_decay_iters = 60
min_lr = 3e-4
eval_interval = 20
eval_iters = 4
device = 'cpu'
# -----------------------------------------------------------------------------

chars = sorted(list(set(TEXT)))
vocab_size = len(chars)
stoi = {ch: i for i, ch in enumerate(chars)}
itos = {i: ch for i, ch in enumerate(chars)}
encode = lambda s: [stoi[c] for c in s]
decode = lambda l: ''.join([itos[i] for i in l])
data = np.array(encode(TEXT * 8), dtype=np.uint16)
n = int(0.9 * len(data))
train_data, val_data = data[:n], data[n:]


def get_batch(split):
    data = train_data if split == 'train' else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i+block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i+1:i+1+block_size]).astype(np.int64)) for i in ix])
    x, y = x.to(device), y.to(device)
    return x, y


@torch.no_grad()
def estimate_loss(model, get_batch=get_batch):
    out = {}
    model.eval()
    for split in ['train', 'val']:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


def make_model():
    model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                      bias=bias, vocab_size=vocab_size, dropout=dropout)
    gptconf = GPTConfig(**model_args)
    model = GPT(gptconf)
    model.to(device)
    return model


def train(model, optimizer, get_batch=get_batch, max_iters=max_iters, log=print):
    losses = []
    X, Y = get_batch('train') # fetch the very first batch
    t0 = time.time()
    for iter_num in range(max_iters):
        # determine and set the learning rate for this iteration
        lr = get_lr(iter_num) if decay_lr else learning_rate
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr

        # evaluate the loss on train/val sets
        if iter_num % eval_interval == 0 and iter_num > 0:
            ev = estimate_loss(model, get_batch)
            log(f"step {iter_num}: train loss {ev['train']:.4f}, val loss {ev['val']:.4f}")

        logits, loss = model(X, Y)
        # immediately async prefetch next batch while model is doing the forward pass
        X, Y = get_batch('train')
        loss.backward()
        # clip the gradient
        if grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        # step the optimizer
        optimizer.step()
        # flush the gradients as soon as we can, no need for this memory anymore
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % 10 == 0:
            log(f"iter {iter_num}: loss {losses[-1]:.4f}, time {dt*1000:.2f}ms")
    return losses


def main(argv=None):
    global max_iters
    parser = argparse.ArgumentParser()
    parser.add_argument('--max_iters', type=int, default=max_iters)
    args = parser.parse_args(argv)
    max_iters = args.max_iters
    torch.manual_seed(1337)
    model = make_model()
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), 'cpu')
    losses = train(model, optimizer, max_iters=max_iters)
    model.eval()
    start = torch.tensor([encode("First")], dtype=torch.long, device=device)
    print(decode(model.generate(start, 40, temperature=0.8, top_k=5)[0].tolist()))
    return losses


if __name__ == '__main__':
    main()
