"""A small byte-level transformer language model trained on the Python standard library's
own sources, with any method of lsgd_hpc.

    mpirun -np 4 python examples/char_lm.py --ranks-per-node 2 --method lsgd --steps 300
    mpirun -np 4 python examples/char_lm.py --method local-sgd --local-steps 8
    mpirun -np 4 python examples/char_lm.py --method diloco --local-steps 16 --outer-lr 0.7
    mpirun -np 4 python examples/char_lm.py --ranks-per-node 2 --method diloco --worker-ranks node
    mpirun -np 4 python examples/char_lm.py --method diloco --local-steps 16 --fragments 4 \
        --fragment-sync-delay 1 --fragment-update-alpha 0.5 --comm-dtype int8 --error-feedback

Every option of every method is a flag of the same name (read from the methods' specs, so it
is the library's option with the library's default when left out).

The corpus is on every machine: the top-level ``*.py`` files of
``sysconfig.get_paths()["stdlib"]``, in sorted order; every 10th file is held out (the test
text), every 10th from the 6th on is the validation text (for choosing settings: results/'s
language-model experiment picks learning rates on it), the rest is training text (capped at
--max-bytes / 10, --max-bytes / 10 and --max-bytes, so start-up is fast).
Every rank trains on random contiguous windows of the training text, drawn from a generator
seeded by (seed, rank, step); the held-out loss is measured on a fixed set of windows of the
held-out text, for the model the method reports (LSGD: the leader's, EASGD: the centre).
Rank 0 prints the held-out loss and perplexity, the training time and the bytes sent; the
metrics go to RUN_DIR/metrics (eval rows: test_loss = held-out loss per byte, in nats, and
val_loss the same on validation windows, a column of this script's own).
"""

import argparse
import glob
import math
import os
import sysconfig

import torch
from torch import nn

import lsgd_hpc
from lsgd_hpc.methods.spec import COMMON_OPTIONS


def corpus(max_bytes):
    """(training, validation, held-out bytes) as uint8 tensors, the same on every rank."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    parts = {"train": [f for i, f in enumerate(files) if i % 10 not in (0, 5)],
             "val": files[5::10], "held": files[::10]}
    caps = {"train": max_bytes, "val": max_bytes // 10, "held": max_bytes // 10}
    out = {}
    for name, names in parts.items():
        data = bytearray()
        for f in names:
            with open(f, "rb") as fh:
                data += fh.read()
            if len(data) >= caps[name]:
                break
        out[name] = torch.frombuffer(data[:caps[name]], dtype=torch.uint8)
    return out["train"], out["val"], out["held"]


def windows(text, starts, context):
    idx = starts[:, None] + torch.arange(context + 1)
    w = text[idx].long()
    return w[:, :-1], w[:, 1:]


class ByteLM(nn.Module):
    def __init__(self, d_model, layers, heads, context):
        super().__init__()
        self.tok = nn.Embedding(256, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, x):
        t = x.shape[1]
        h = self.tok(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="lsgd", choices=list(lsgd_hpc.METHODS))
    # every method's options, as flags named after them (--tau-local, --fragments,
    # --comm-dtype, ...), read from the methods' specs: an option left out keeps the library's
    # default (lsgd_hpc.METHODS[NAME].defaults), a bad value is the library's ValueError
    specs = {o.name: o for cls in lsgd_hpc.METHODS.values() for o in cls.spec.options
             if o.cli}
    specs.update({o.name: o for o in COMMON_OPTIONS})
    for o in specs.values():
        if o.kind == "bool":
            p.add_argument(o.flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            p.add_argument(o.flag, default=None, metavar=o.name.upper())
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--steps", type=int, default=300, help="steps per rank")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--max-bytes", type=int, default=2_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="runs/char_lm")
    a = p.parse_args()
    cls = lsgd_hpc.METHODS[a.method]
    mine = {o.name for o in cls.spec.options} | {o.name for o in COMMON_OPTIONS}
    options = {k: specs[k].parse(v) for k, v in vars(a).items() if k in mine and v is not None}

    comm = lsgd_hpc.init(backend="mpi", ranks_per_node=a.ranks_per_node)
    train_text, val_text, held_text = corpus(a.max_bytes)
    g = torch.Generator().manual_seed(12345)          # the same held-out windows everywhere
    held = windows(held_text, torch.randint(len(held_text) - a.context - 1,
                                            (a.eval_windows,), generator=g), a.context)
    val = windows(val_text, torch.randint(len(val_text) - a.context - 1,
                                          (a.eval_windows,), generator=g), a.context)
    torch.manual_seed(a.seed)
    model = ByteLM(a.d_model, a.layers, a.heads, a.context).to(comm.device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / a.warmup)
                                              * 0.5 * (1 + math.cos(math.pi * min(s, a.steps)
                                                                    / a.steps)))
    method = lsgd_hpc.METHODS[a.method](model, opt, comm, max_steps=a.steps, **options)
    metrics = lsgd_hpc.open_metrics(a.run_dir, comm, method=method, config=vars(a),
                                    extra_columns={"eval": {"val_loss": "f8"}})
    loss_fn = nn.CrossEntropyLoss()

    def held_out_loss(m):
        with metrics.measuring(), torch.no_grad():
            x, y = (t.to(comm.device) for t in held)
            out = m(x)
            loss = float(loss_fn(out.reshape(-1, 256), y.reshape(-1)))
            acc = float((out.argmax(-1) == y).float().mean())
            x, y = (t.to(comm.device) for t in val)
            val_loss = float(loss_fn(m(x).reshape(-1, 256), y.reshape(-1)))
        metrics.log_eval(method.steps, loss, acc, val_loss=val_loss)
        return loss

    initial = held_out_loss(model)          # step 0: every rank holds rank 0's x_0
    while not method.done:
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + comm.rank * 100_003
                                          + method.steps)
        starts = torch.randint(len(train_text) - a.context - 1, (a.batch_size,), generator=g)
        x, y = (t.to(comm.device) for t in windows(train_text, starts, a.context))
        loss = loss_fn(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        method.synchronize()                     # gradients complete before clipping
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        method.step(loss)
        sched.step()
        metrics.log_step(method.steps, loss.item(), lr=sched.get_last_lr()[0])
        # async LSGD's ranks take uneven steps: it is evaluated at the end only
        if a.eval_every and method.steps % a.eval_every == 0 and a.method != "lsgd-async" \
                and not method.done:
            with method.reported_model() as m:
                held_out_loss(m)
    with method.reported_model() as m:
        final = held_out_loss(m)
    metrics.flush()
    sent = sum(comm.allgather_object(comm.stats.bytes_sent))
    steps = comm.allgather_object(method.steps)
    if comm.rank == 0:
        print(f"{a.method}: held-out loss {initial:.3f} -> {final:.3f} nats/byte "
              f"(perplexity {math.exp(final):.2f}) after {steps} steps per rank; "
              f"{sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{len(train_text):,} training and {len(held_text):,} held-out bytes; "
              f"training time {metrics.training_time():.1f} s, {sent / 2**20:.1f} MiB sent "
              "by all ranks", flush=True)


if __name__ == "__main__":
    main()
