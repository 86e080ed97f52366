"""aggregate's grouping keys: runs that differ only in the seed or in bookkeeping (where and
how often they write) are one configuration, drawn as a mean with a band; runs that differ in
anything that changes what is trained are separate lines, labelled by that option."""

from dataclasses import dataclass

import pytest

from lsgd_hpc.analysis import aggregate as agg

BASE = dict(algorithm="lsgd", dataset="digits", model="digits_cnn", epochs=8, batch_size=32,
            lr=0.05, lr_schedule="constant", momentum=0.9, weight_decay=1e-4, tau_local=4,
            tau_global=8, pull_local=0.1, pull_global=0.1, topology="ring", local_steps="8",
            world_size=4, ranks_per_node=2, max_steps=None, total_steps=88, steps_per_epoch=11,
            seed=0, run_dir="runs/a", resume=False, config=None, data_dir=None,
            flush_every=200, flush_seconds=60.0, log_every=1, checkpoint_every=0,
            eval_batch_size=1000)


@dataclass
class FakeRun:
    """What group_runs reads of a run."""
    name: str
    config: dict

    @property
    def algorithm(self):
        return self.config["algorithm"]

    @property
    def seed(self):
        return self.config["seed"]


def run(name, **changes):
    return FakeRun(name, {**BASE, **changes})


@pytest.mark.parametrize("key,value", [
    ("seed", 7), ("run_dir", "elsewhere"), ("resume", True), ("config", "my.yaml"),
    ("data_dir", "/scratch/data"), ("flush_every", 5), ("flush_seconds", 1.0),
    ("log_every", 10), ("checkpoint_every", 100), ("eval_batch_size", 250)])
def test_seed_and_bookkeeping_do_not_split(key, value):
    assert agg.config_key(run("a").config) == agg.config_key(run("b", **{key: value}).config)
    groups = agg.group_runs([run("a"), run("b", **{key: value})])
    assert len(groups) == 1 and [r.name for r in groups[0].runs] == ["a", "b"]
    assert key not in groups[0].config
    assert groups[0].label == "lsgd (2 seeds)"


@pytest.mark.parametrize("key,value", [
    ("algorithm", "easgd"), ("lr", 0.1), ("lr_schedule", "cosine"), ("momentum", 0.0),
    ("batch_size", 64), ("epochs", 4), ("tau_local", 2), ("tau_global", 16),
    ("pull_global", 0.5), ("topology", "torus"), ("local_steps", "auto"), ("model", "mlp"),
    ("dataset", "synthetic"), ("world_size", 8), ("ranks_per_node", 4)])
def test_what_changes_training_splits_and_labels(key, value):
    a, b = run("a"), run("b", **{key: value})
    assert agg.config_key(a.config) != agg.config_key(b.config)
    groups = agg.group_runs([a, b])
    assert [[r.name for r in g.runs] for g in groups] == [["a"], ["b"]]
    if key == "algorithm":
        assert [g.label for g in groups] == ["lsgd", "easgd"]
    else:
        fmt = (lambda v: f"{v:g}") if isinstance(value, float) else str
        assert groups[0].label == f"lsgd {key}={fmt(BASE[key])}"
        assert groups[1].label == f"lsgd {key}={fmt(value)}"


def test_derived_step_counts_split_but_never_label():
    a = run("a")
    b = run("b", max_steps=40, total_steps=40)
    groups = agg.group_runs([a, b])
    assert len(groups) == 2
    assert [g.label for g in groups] == ["lsgd max_steps=None", "lsgd max_steps=40"]


def test_groups_keep_first_appearance_order_and_collect_seeds():
    runs = [run("x1", lr=0.1, seed=1), run("y1", seed=1), run("x2", lr=0.1, seed=2),
            run("y2", seed=2, run_dir="runs/y2")]
    groups = agg.group_runs(runs)
    assert [[r.name for r in g.runs] for g in groups] == [["x1", "x2"], ["y1", "y2"]]
    assert [g.seeds for g in groups] == [[1, 2], [1, 2]]
    assert [g.label for g in groups] == ["lsgd lr=0.1 (2 seeds)", "lsgd lr=0.05 (2 seeds)"]
