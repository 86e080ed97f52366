"""The trainer's evaluation: the worker's model on the test set (and the validation slice),
and every extra model its method reports (EASGD's centre), each with BatchNorm statistics
of its own when no worker trained it."""

from __future__ import annotations

from typing import Dict

__all__ = ["Evaluator"]


class Evaluator:
    """``evaluator(step)``: the /eval row of ``step`` (test_loss, test_accuracy, val_* with a
    validation slice, and <name>_test_* for each of the rule's ``eval_models``)."""

    def __init__(self, model, flat, rule, ds, batches, validation, device, batch_size: int,
                 bn_batches: int):
        self.model, self.flat, self.rule, self.ds = model, flat, rule, ds
        self.batches, self.validation, self.device = batches, validation, device
        self.batch_size, self.bn_batches = batch_size, bn_batches

    def loss_accuracy(self, batches=None):
        """(mean loss, accuracy) of the current model on the test set, or on ``batches``."""
        import torch
        self.model.eval()
        total, correct, loss_sum = 0, 0, 0.0
        with torch.no_grad():
            for xb, yb in batches or self.ds.test_batches(self.batch_size):
                xb, yb = xb.to(self.device), yb.to(self.device)
                out = self.model(xb)
                loss_sum += float(torch.nn.functional.cross_entropy(out, yb, reduction="sum"))
                correct += int((out.argmax(1) == yb).sum())
                total += len(yb)
        self.model.train()
        return loss_sum / total, correct / total

    def __call__(self, step: int) -> Dict[str, float]:
        row = self._rows("")
        extra = self.rule.eval_models()
        if extra:
            from lsgd_hpc.models.batchnorm import int_buffers, recompute_bn_stats
            saved = self.flat.flat.clone()
            saved_ints = [b.clone() for b in int_buffers(self.model)]
            for name, vec in extra.items():
                self.flat.flat.copy_(vec)
                if self.bn_batches:   # no worker trained this model: its own statistics
                    recompute_bn_stats(self.model, self._bn_inputs(step))
                row.update(self._rows(f"{name}_"))
            # the worker's own parameters and statistics, untouched by the above
            self.flat.flat.copy_(saved)
            for b, v in zip(int_buffers(self.model), saved_ints):
                b.copy_(v)
        return row

    def _rows(self, prefix: str) -> Dict[str, float]:
        row = {}
        row[f"{prefix}test_loss"], row[f"{prefix}test_accuracy"] = self.loss_accuracy()
        if self.validation is not None:
            x, y, b = *self.validation, self.batch_size
            slices = [(x[i:i + b], y[i:i + b]) for i in range(0, len(y), b)]
            row[f"{prefix}val_loss"], row[f"{prefix}val_accuracy"] = self.loss_accuracy(slices)
        return row

    def _bn_inputs(self, step: int):
        """The first ``bn_batches`` training inputs of this rank from the current epoch on
        (read from the batches, whose order and state the training does not share)."""
        epoch, n = int(self.batches.epoch_of(step)), 0
        while n < self.bn_batches:
            for xb, _ in self.batches.batches(epoch, 0):
                if n == self.bn_batches:
                    return
                n += 1
                yield xb.to(self.device)
            epoch += 1
