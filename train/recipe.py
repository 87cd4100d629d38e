"""Recipe cards: a composed experiment beside the reference recipe it claims, row by row.

    python -m train.recipe experiment=gpt_d20                  # print the card (Markdown)
    python -m train.recipe experiment=deit3_in1k model=vitb_12L optim.lr=1e-3   # any overrides
    python -m train.recipe --all                               # every card -> docs/recipes/

A card's reference is a plain YAML file, configs/reference/<experiment>.yaml: the reference's
values are facts written in our own files (where each comes from: `sources`), each row naming
what of ours it is compared with:

    - {name: LAMB lr, ours: optim.lr, ref: 3.0e-3, src: deit}             # a config value
    - {name: lr at 5 epochs, ours: "@sched(optim.schedules.lr, 5ep)", ref: 3.0e-3, src: deit}
    - {name: Muon on q, k, v, ours_is: separate, held_by: "tests/test_x.py::test_y", ...}

`ours` is a dotted key of the composed config (`knn:crop_pct` for an evaluation's entry config)
or `@<quantity>(args)`, a method of `Recipe` computed with the trainers' own code on the meta
device (no data, no memory). A row whose values differ must say why: `deliberate: <reason>` or
`unknown: <reason>`; tests/test_recipes.py composes every experiment and fails on any row without.
"""
import argparse
import math
import re
import sys
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from laplace.errors import ConfigError, cli_errors

from . import get_trainer
from .feeds import MapFeed
from .optim import Schedule, parse_length
from .plan import nanochat_scaling, resolve_batch, step_plan, uses_token_budget

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
REFERENCES = CONFIGS / "reference"
OUT = ROOT / "docs" / "recipes"
ROW_KEYS = {"name", "ours", "ours_is", "held_by", "ref", "src", "note", "deliberate", "unknown"}
NEEDS_SIZE = "this card needs `assume.train_size` (training examples per epoch)"


def compose_config(overrides: list[str], config_name: str = "config") -> DictConfig:
    """The config `python train.py <overrides>` (or another entry config) would run with."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


class Recipe:
    """What a composed experiment trains with, computed lazily with the trainers' own code.

    Args:
        cfg: the composed training config.
        train_size: training examples per epoch of the reference's data (ImageNet-1k: 1,281,167),
            for map-style data; token-budget runs ignore it.
        eval_overrides: {entry config: overrides} for rows such as `knn:crop_pct`.
    """

    def __init__(self, cfg: DictConfig, train_size: int | None = None,
                 eval_overrides: dict[str, list[str]] | None = None):
        self.cfg, self.train_size = resolve_batch(cfg), train_size  # optim=muon26: its batch rule
        self.eval_overrides = eval_overrides or {}

    @cached_property
    def trainer(self):
        """The experiment's trainer with its model and optimizers only, on the meta device."""
        return get_trainer(self.cfg.trainer.name).offline(self.cfg)

    def params(self) -> int:
        """Parameters of the network a checkpoint holds (DINO: the teacher backbone)."""
        return sum(p.numel() for p in self.trainer.exported.parameters())

    @cache  # computed once per world size (a card's argument is a string, "8")
    def plan(self, world_size: int | str = 1):
        """The engine's step plan (train/plan.py) on `world_size` processes, an epoch being
        `train_size` examples counted on one process (None on more: only the split is known)."""
        per_epoch = None  # token shards have no epoch: their budget counts
        if int(world_size) == 1 and self.train_size is not None and not uses_token_budget(self.cfg):
            # The engine's own feed over the trainer's own sampler: DeiT-III's repeated
            # augmentation keeps a multiple of 256 images, and an epoch ends on a whole step.
            examples = range(int(self.train_size))  # only its length is used
            feed = MapFeed(examples, self.trainer.sampler(examples), step_plan(self.cfg, 1, None).micro_batch,
                           step_size=self.cfg.trainer.global_batch_size)
            per_epoch = feed.micro_batches_per_epoch
        return step_plan(self.cfg, int(world_size), per_epoch)

    def micro_batch(self, world_size: int = 1) -> int:
        """Examples per process per forward on `world_size` processes."""
        return self.plan(world_size).micro_batch

    def accum(self, world_size: int = 1) -> int:
        return self.plan(world_size).accum

    def steps_per_epoch(self) -> int:
        """Optimizer steps in an epoch of `train_size` examples (a token budget: the run)."""
        plan = self.plan()
        if plan.steps_per_epoch is None and not plan.token_budget:
            raise ConfigError(NEEDS_SIZE)
        return plan.steps_per_epoch or self.total_steps()  # (a plan's steps per epoch are at least 1)

    def total_steps(self) -> int:
        if self.plan().total_steps is None:  # epochs of unknown size
            raise ConfigError(NEEDS_SIZE)
        return self.plan().total_steps

    def tokens_per_step(self) -> int:
        return self.cfg.trainer.global_batch_size * self.cfg.data.seq_len

    def scaling(self, field: str):
        """A field of optim=muon26's horizon and scales (train/plan.py Scaling)."""
        return getattr(nanochat_scaling(self.cfg), field)

    def sched(self, path: str, at: str) -> float:
        """A schedule's value at a step: "<n>", "<n>ep", "<p>%" or "end" (the last step)."""
        node = OmegaConf.select(self.cfg, path)
        if node is None:
            raise ConfigError(f"{path}: no such schedule in the composed config")
        node, total = OmegaConf.to_container(node, resolve=True), self.total_steps()
        # Steps per epoch are needed only where a length counts in epochs (steps_per_epoch() says
        # NEEDS_SIZE where it is unknown); elsewhere, and under a token budget, the plan's or 1.
        epochs = any(str(v).strip().endswith("ep") for v in [*node.values(), at])
        plan = self.plan()
        spe = self.steps_per_epoch() if epochs and not plan.token_budget else plan.steps_per_epoch or 1
        schedule = Schedule.from_config(node, path, total, spe)
        return schedule(total - 1 if at == "end" else parse_length(at, at, spe, total))

    def group(self, opt: str, group: str, key: str):
        """A parameter group's hyper-parameter as the optimizer was built (before schedules);
        group "*": the first (an optimizer whose groups differ in weight decay only)."""
        groups = self.trainer.optimizers[opt].param_groups
        found = groups[:1] if group == "*" else [g for g in groups if g.get("name") == group]
        if not found:
            raise ConfigError(f"optimizer {opt!r} has no group {group!r} (groups: {[g.get('name') for g in groups]})")
        return found[0][key]

    def no_decay(self) -> list[str]:
        """Kinds of parameters the optimizers keep out of weight decay (a name's last part, or norm)."""
        names = {id(p): n for n, p in self.trainer.model.named_parameters()}

        def kind(name):  # a norm's weight and bias are "norm", any other parameter its name's last part
            return "norm" if "norm" in name and name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]

        return sorted({kind(names[id(p)]) for opt in self.trainer.optimizers.values() for g in opt.param_groups
                       if g.get("weight_decay", 0.0) == 0.0 for p in g["params"] if id(p) in names})

    def list(self, *keys: str) -> list:
        return [self.value(k) for k in keys]

    def not_(self, key: str) -> bool:
        return not self.value(key)

    def mixture(self, split: str) -> "list[str]":
        """A chat mixture's sources, one "<task> [subset] <split> [(max examples)]" each."""
        out = []
        for src in OmegaConf.to_container(self.cfg.data[split], resolve=True):
            words, n = [src["task"], src.get("subset"), src.get("split")], src.get("max_examples")
            out.append(" ".join(w for w in words if w) + (f" ({n})" if n else ""))
        return out

    @cache
    def entry(self, name: str) -> DictConfig:
        """An evaluation's entry config (knn, linear, segmentation) with the card's overrides."""
        return compose_config(self.eval_overrides.get(name, []), name)

    def value(self, expr: str):
        """A row's `ours`: `@quantity(args)` (a method above), `entry:key` or a config key."""
        if m := re.fullmatch(r"@(\w+)\((.*)\)", expr.strip()):
            fn = getattr(self, "not_" if m[1] == "not" else m[1], None)
            if m[1].startswith("_") or not callable(fn):
                raise ConfigError(f"{expr}: unknown quantity @{m[1]}")
            return fn(*[a.strip() for a in m[2].split(",")] if m[2].strip() else [])
        entry, _, key = expr.rpartition(":")
        cfg, missing = self.entry(entry) if entry else self.cfg, object()
        try:
            v = OmegaConf.select(cfg, key, default=missing, throw_on_missing=True)
        except MissingMandatoryValue:
            return "???"  # mandatory: the command line sets it (init=finetune's trainer.init_from)
        if v is missing:
            raise ConfigError(f"{expr}: no such key in the composed config")
        return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v


def same(a, b) -> bool:
    """Equal, floats to a relative 1e-6 (YAML's 3.0e-3 against a computed 0.003)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


# A row's status: its mark and its text in the card (a failing status is in bold).
STATUS = {"equal": ("=", "equal"), "deliberate": ("≠", "deliberate: {}"), "unknown": ("?", "unknown: {}"),
          "DIFFERS": ("✗", "**DIFFERS, no reason written**"),
          "STALE": ("✗", "**equal, but marked deliberate**: {}")}  # a reason for a difference that is gone


@dataclass
class Row:
    name: str
    ours: object
    ref: object
    src: str
    status: str  # equal | deliberate | unknown | DIFFERS | STALE
    reason: str = ""
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("equal", "deliberate", "unknown")


def evaluate_rows(recipe: Recipe, rows: list[dict], where: str) -> list[Row]:
    out = []
    for i, r in enumerate(rows):
        if unknown_keys := set(r) - ROW_KEYS:
            raise ConfigError(f"{where} row {i}: unknown key {sorted(unknown_keys)[0]!r}; use {sorted(ROW_KEYS)}")
        if ("ours" in r) == ("ours_is" in r):
            raise ConfigError(f"{where} row {i} ({r.get('name')}): give exactly one of ours / ours_is")
        # A behaviour no config value shows is stated, and a test must hold it.
        if "ours_is" in r and not r.get("held_by"):
            raise ConfigError(f"{where} row {i} ({r.get('name')}): ours_is needs held_by (the test that holds it)")
        ours = r["ours_is"] if "ours_is" in r else recipe.value(str(r["ours"]))
        kind = "deliberate" if r.get("deliberate") else "unknown" if r.get("unknown") else ""
        if same(ours, r.get("ref")):  # a reason for a difference that is gone is stale
            status = "STALE" if kind == "deliberate" else (kind or "equal")
        else:
            status = kind or "DIFFERS"
        note = r.get("note", "") + (f" (held by `{r['held_by']}`)" if r.get("held_by") else "")
        out.append(Row(r["name"], ours, r.get("ref"), r.get("src", ""), status, r.get(kind, ""), note.strip()))
    return out


def reference_recipe(experiment: str, extra: list[str] = ()) -> tuple[dict, Recipe]:
    """(reference file, Recipe) of an experiment composed with its card's overrides + `extra`
    (the card's, and scripts/paper_runs.py's costs)."""
    path = REFERENCES / f"{experiment}.yaml"
    if not path.is_file():
        raise ConfigError(f"experiment={experiment}: no recipe card ({path.relative_to(ROOT)} is missing); "
                          f"write one (see train/recipe.py)")
    ref = yaml.safe_load(path.read_text())
    cfg = compose_config([f"experiment={experiment}", *ref.get("overrides", []), *extra])
    return ref, Recipe(cfg, ref.get("assume", {}).get("train_size"), ref.get("eval_overrides"))


def card(experiment: str, extra: list[str] = ()) -> tuple[dict, list[Row]]:
    """(reference file, rows) for an experiment composed with the card's overrides + `extra`."""
    ref, recipe = reference_recipe(experiment, extra)
    return ref, evaluate_rows(recipe, ref["rows"], f"configs/reference/{experiment}.yaml")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return "—" if v is None else str(v)


def _counts(rows: list[Row]) -> list[int]:
    return [sum(r.status == s for r in rows) for s in ("equal", "deliberate", "unknown")]


def render(experiment: str, ref: dict, rows: list[Row], overrides: list[str] = ()) -> str:
    given = {o.split("=", 1)[0] for o in overrides}  # the command line's own replace the card's
    shown = [o for o in ref.get("overrides", []) if o.split("=", 1)[0] not in given] + list(overrides)
    assume = ", ".join(f"{k} {v}" for k, v in ref.get("assume", {}).items())
    lines = [f"# Recipe card: `experiment={experiment}`", "", ref.get("title", "").strip(), "",
             f"Composed from `python train.py experiment={experiment} " + " ".join(shown) + "`"
             + (f"; assumed: {assume}" if assume else "") + ". Regenerate with `python -m train.recipe --all`.",
             "", "Sources:", "", *(f"- **{k}**: {v}" for k, v in ref.get("sources", {}).items()),
             "", "| | hyper-parameter | ours | reference | source | status |", "|---|---|---|---|---|---|"]
    for r in rows:
        mark, text = STATUS[r.status]
        status = text.format(r.reason) + (f" — {r.note}" if r.note else "")
        lines.append(f"| {mark} | {r.name} | {_fmt(r.ours)} | {_fmt(r.ref)} | {r.src} | {status} |")
    equal, deliberate, unknown = _counts(rows)
    bad = sum(not r.ok for r in rows)
    lines += ["", f"{len(rows)} rows: {equal} equal, {deliberate} deliberate differences, {unknown} unknown"
              + (f", **{bad} unexplained**" if bad else "") + "."]
    return "\n".join(lines) + "\n"


def experiments() -> list[str]:
    return sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))


def write_all(out: Path) -> int:
    """Every experiment's card and an index into `out`; returns the number of unexplained rows."""
    out.mkdir(parents=True, exist_ok=True)
    index = ["# Recipe cards", "", "One card per experiment: our composed recipe beside the reference it claims "
             "(`python -m train.recipe --all` writes them; tests/test_recipes.py holds them).", "",
             "| experiment | rows | equal | deliberate | unknown |", "|---|---|---|---|---|"]
    bad = 0
    for exp in experiments():
        ref, rows = card(exp)
        (out / f"{exp}.md").write_text(render(exp, ref, rows))
        bad += sum(not r.ok for r in rows)
        index.append(f"| [{exp}]({exp}.md) | {len(rows)} | " + " | ".join(map(str, _counts(rows))) + " |")
    (out / "README.md").write_text("\n".join(index) + "\n")
    print(f"wrote {len(experiments())} cards to {out}" + (f"; {bad} unexplained rows" if bad else ""))
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.recipe", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="experiment=NAME and any Hydra overrides")
    p.add_argument("--all", action="store_true", help="write every experiment's card to --out")
    p.add_argument("--out", default=str(OUT), help="folder of the rendered cards (with --all)")
    args = p.parse_args(argv)
    if args.all:
        return 1 if write_all(Path(args.out)) else 0
    exps = [o.split("=", 1)[1] for o in args.overrides if o.startswith("experiment=")]
    if len(exps) != 1:
        raise ConfigError(f"give one experiment=NAME (one of: {', '.join(experiments())})")
    extra = [o for o in args.overrides if not o.startswith("experiment=")]
    ref, rows = card(exps[0], extra)
    print(render(exps[0], ref, rows, extra), end="")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(cli_errors(main)())
