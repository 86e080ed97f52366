"""What the trainer builds from its options besides the method: the data loader's options, the
worker's optimizer, the learning-rate schedule, the validation and held-out slices, and the
held-out leader score."""

from __future__ import annotations

import math

__all__ = ["loader_options", "make_optimizer", "lr_at", "validation_split", "heldout_split", "heldout_score_fn"]


def loader_options(cfg) -> dict:
    """The keyword arguments of ``lsgd_hpc.data.loaders.load_dataset`` that come from a
    training Config besides the positional ones: image size, DataLoader workers, pinned memory
    for CUDA (the data layer takes them as explicit arguments)."""
    return dict(image_size=cfg.image_size, data_workers=cfg.data_workers,
                pin_memory=cfg.device == "cuda")


def make_optimizer(cfg, params):
    """The worker's own optimizer over the model's parameters (the method steps it).

    sgd: with momentum mu and weight decay wd,
        g <- g + wd x;   b <- mu b + g;   x <- x - lr (g + mu b)  (Nesterov)  or  x - lr b,
    Nesterov's form being the reference LSGD's choice whenever mu > 0 (--nesterov).
    adamw: AdamW (decoupled weight decay wd) with betas (--momentum, 0.999)."""
    import torch
    if getattr(cfg, "optimizer", "sgd") == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.momentum, 0.999),
                                 weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, nesterov=bool(cfg.nesterov))


def lr_at(cfg, step: int, total: int) -> float:
    """The schedule's learning rate at ``step`` (0-based), times a linear warmup ramp
    (step + 1) / warmup over the first --warmup-steps steps."""
    warm = getattr(cfg, "warmup_steps", 0) or 0
    ramp = min(1.0, (step + 1) / warm) if warm else 1.0
    if cfg.lr_schedule == "step":
        return ramp * cfg.lr * (0.1 ** (int(step >= 0.5 * total) + int(step >= 0.75 * total)))
    if cfg.lr_schedule == "cosine":
        return ramp * 0.5 * cfg.lr * (1 + math.cos(math.pi * step / max(1, total)))
    return ramp * cfg.lr


def validation_split(cfg, ds):
    """``(training set, validation slice)``: with --validation-size N, N training samples (the
    same on every rank, drawn from --seed) taken out of training and returned as normalized
    ``(x, y)`` for the evaluations' val_loss and val_accuracy; otherwise ``(ds, None)``."""
    if not getattr(cfg, "validation_size", 0):
        return ds, None
    from lsgd_hpc.data.splits import split_validation
    train, idx = split_validation(ds, cfg.validation_size, cfg.seed)
    return train, (ds.normalize(ds.x_train[idx]), ds.y_train[idx])


def heldout_split(cfg, ds):
    """``(training set, held-out slice)``: with --leader-score heldout, the slice (the same
    samples on every rank, drawn from --seed) is taken out of the training set and returned
    as normalized ``(x, y)``; otherwise ``(ds, None)``."""
    if getattr(cfg, "leader_score", "train") != "heldout":
        return ds, None
    from lsgd_hpc.data.splits import default_heldout_size, split_heldout
    size = cfg.heldout_size if cfg.heldout_size is not None else default_heldout_size(ds.n_train)
    train, idx = split_heldout(ds, size, cfg.seed)
    return train, (ds.normalize(ds.x_train[idx]), ds.y_train[idx])


def heldout_score_fn(model, heldout, world, device, batch_size: int):
    """LSGD's election score under --leader-score heldout: the model's mean cross-entropy on
    the held-out slice (eval mode, no gradient; BatchNorm statistics untouched). Its time is
    booked as measurement (probe_seconds), left out of the training time."""
    import torch

    from lsgd_hpc.comm import uncounted
    x, y = heldout[0].to(device), heldout[1].to(device)

    def score() -> float:
        with uncounted(world, probe=True), torch.no_grad():
            was_training = model.training
            model.eval()
            total = 0.0
            for i in range(0, len(y), batch_size):
                out = model(x[i:i + batch_size])
                total += float(torch.nn.functional.cross_entropy(out, y[i:i + batch_size],
                                                                 reduction="sum"))
            model.train(was_training)
        return total / len(y)
    return score
