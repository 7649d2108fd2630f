import re
from dataclasses import dataclass
from typing import Literal

import pandas as pd
import pytest

from workbench.core.config import VOCABULARY, Config, ConfigError, param
from workbench.core.results import StudyResult
from workbench.front.live import LiveChart
from workbench.studies.ladder.config import LadderConfig
from workbench.studies.split.config import SplitConfig
from workbench.studies.strategies.config import StrategiesConfig


@dataclass(frozen=True)
class Demo(Config):
    steps: int = param(10, "steps")
    lr: float = param(1e-3, "learning rate")
    name: str = param("x", "a name")
    seeds: tuple[int, ...] = param((0,), "seeds")
    mode: Literal["a", "b"] = param("a", "a mode")
    flag: bool = param(False, "a flag")


def test_unknown_names_are_rejected_with_the_known_ones_listed():
    with pytest.raises(ConfigError, match=r"unknown parameter for Demo: stpes.*Known: steps"):
        Demo.from_dict({"stpes": 3})


BAD = [
    {"steps": "10"}, {"steps": 1.5}, {"steps": True}, {"lr": "fast"}, {"lr": True}, {"seeds": 3},
    {"seeds": ["a"]}, {"mode": "c"}, {"flag": 1}, {"name": 3},
    {"lr": float("nan")}, {"lr": float("inf")}, {"lr": -float("inf")}, {"steps": 1e99},
]


@pytest.mark.parametrize("values", BAD)
def test_wrong_types_are_rejected(values):
    with pytest.raises(ConfigError):
        Demo.from_dict(values)


@pytest.mark.parametrize("values", BAD)
def test_configs_built_directly_are_checked_the_same_way(values):
    with pytest.raises(ConfigError):
        Demo(**values)


def test_non_finite_floats_name_the_parameter():
    with pytest.raises(ConfigError, match="lr: expected a finite number, got nan"):
        Demo(lr=float("nan"))


def test_an_optional_parameter_says_why_its_value_is_wrong():
    """Not "alpha: inf is not float | None" (inf is a float): the number's own reason, and None allowed."""
    with pytest.raises(ConfigError, match=r"^alpha: expected a finite number, got inf \(or None\)$"):
        SplitConfig(alpha=float("inf"))
    with pytest.raises(ConfigError, match=r"^alpha: expected a number, got str 'fast' \(or None\)$"):
        SplitConfig.from_dict({"alpha": "fast"})
    assert SplitConfig(alpha=None).alpha is None and SplitConfig(alpha=2).alpha == 2.0


@pytest.mark.parametrize("cls", [StrategiesConfig, LadderConfig, SplitConfig])
def test_a_one_token_block_is_refused_by_every_study(cls):
    """seq_len=1 passed each study's "positive" check and ended in data.token_blocks' ValueError traceback."""
    with pytest.raises(ConfigError, match=r"^seq_len must be at least 2 \(a block of one token has no next token"):
        cls.from_dict({"seq_len": 1})
    assert cls.from_dict({"seq_len": 2}).seq_len == 2


def test_a_subclass_checks_run_after_the_type_checks():
    with pytest.raises(ConfigError, match="lr: expected a finite number"):
        StrategiesConfig(lr=float("inf"))
    with pytest.raises(ConfigError, match="token_budget must be positive"):
        StrategiesConfig(token_budget=0)  # the subclass's own __post_init__ still runs
    assert StrategiesConfig(seeds=[0, 1]).seeds == (0, 1)  # coerced as from_dict does


def test_an_empty_list_of_strategies_or_seeds_names_what_to_give():
    with pytest.raises(ConfigError, match=r"^strategies is empty: give at least one, e.g. strategies=\[full\]; "
                                          r"known: .*full"):
        StrategiesConfig.from_dict({"strategies": []})
    with pytest.raises(ConfigError, match=r"^seeds is empty: give at least one seed, e.g. seeds=\[0\]$"):
        StrategiesConfig.from_dict({"seeds": []})


def test_lossless_coercions():
    cfg = Demo.from_dict({"lr": 1, "steps": 4.0, "seeds": [1, 2]})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.steps == 4 and cfg.seeds == (1, 2)
    # `reference_model=` (the help's "'': none") on a command line: YAML reads the empty value as null
    assert LadderConfig.from_dict({"reference_model": None}).reference_model == ""


def test_from_namespace_takes_plain_values_and_rejects_strays():
    import math

    ns = {"steps": 5, "math": math, "Demo": Demo, "print": print, "_private": 1, "In": [], "Out": {}}
    assert Demo.from_namespace(ns).steps == 5
    with pytest.raises(ConfigError, match="unknown parameter.*typo"):
        Demo.from_namespace({**ns, "typo": 3})


def test_a_notebook_runs_again_in_the_same_kernel():
    """Run All a second time (after editing a parameter): the first run's `cfg`, live chart and result
    are still in the namespace; `cfg` and the result were refused as unknown parameters. A stray
    plain name still is."""
    ns = {"base_size": "tiny", "steps": 4}
    cfg = SplitConfig.from_namespace(ns)
    ns.update(cfg=cfg, live=LiveChart(title="t", display=False), result=StudyResult("split", runs=pd.DataFrame()),
              steps=5)
    assert SplitConfig.from_namespace(ns) == cfg.replace(steps=5)
    with pytest.raises(ConfigError, match="unknown parameter.*stpes"):
        SplitConfig.from_namespace({**ns, "stpes": 6})


def test_hash_is_stable_and_sensitive():
    a, b = Demo(), Demo.from_dict({"steps": 11})
    assert a.hash() == Demo().hash() and a.hash() != b.hash()
    assert a.replace(steps=11) == b


def test_the_ladders_breakdown_follows_the_rungs_chosen():
    """`workbench ladder rungs=[fp32, lora]` was refused: the breakdown's default, bf16_ckpt, was not among them."""
    assert LadderConfig().breakdown_rung == "bf16_ckpt"
    assert LadderConfig.from_dict({"rungs": ["fp32", "lora"]}).breakdown_rung == "fp32"
    assert LadderConfig.from_dict({"rungs": ["lora", "bf16_ckpt"]}).breakdown_rung == "bf16_ckpt"
    with pytest.raises(ConfigError, match="'lora' is not among rungs: fp32 .name one of them, or '' for the default"):
        LadderConfig.from_dict({"rungs": ["fp32"], "breakdown_rung": "lora"})  # one asked for is checked


def test_every_study_uses_the_shared_vocabulary():
    """A setting that means the same thing has one name, one type and one help text in every study."""
    from typing import get_type_hints

    # names the vocabulary replaced: none of them may come back
    retired = {"tiny", "batch", "batch_size", "iterations", "seq", "warmup", "reference_seq", "reference_batch",
               "modelled_batch", "modelled_seq"}
    for cls in (StrategiesConfig, LadderConfig, SplitConfig):
        hints = get_type_hints(cls)
        assert not retired & set(cls.fields()), cls.__name__
        for name, f in cls.fields().items():
            if name in VOCABULARY:
                tp, help_ = VOCABULARY[name]
                assert hints[name] == tp, (cls.__name__, name)
                assert f.metadata["help"].startswith(help_) and f.metadata.get("setting") == name, (cls.__name__, name)
    shared = set(StrategiesConfig.fields()) & set(LadderConfig.fields()) & set(SplitConfig.fields())
    assert {"model", "base_size", "seq_len", "micro_batch", "lr"} <= shared


@pytest.mark.parametrize("config", ["StrategiesConfig", "SplitConfig"])
def test_a_corpus_that_does_not_exist_is_refused_as_the_settings_are_made(config, tmp_path):
    """Study 1 built the embedded base (minutes) before it found the corpus missing."""
    cls = {"StrategiesConfig": StrategiesConfig, "SplitConfig": SplitConfig}[config]
    with pytest.raises(ConfigError, match=rf"^corpus '{tmp_path}/none' does not exist; give a text file, a folder "
                                          r"of them, or 'embedded' \(Python's language reference\)$"):
        cls.from_dict({"corpus": str(tmp_path / "none")})
    (tmp_path / "notes.txt").write_text("text\n\nmore text")  # two paragraphs: one to hold out
    assert cls.from_dict({"corpus": str(tmp_path / "notes.txt")}).corpus == str(tmp_path / "notes.txt")
    assert cls().corpus == "embedded"


@pytest.mark.parametrize("make, said", [
    (lambda: LadderConfig(rungs=("fp32", "bf16", "fp32")), "rungs repeats fp32: give each once"),
    (lambda: SplitConfig(k_sweep=(0.0, 0.5, 0.5, 1.0)), "k_sweep repeats 0.5: give each once"),
    (lambda: SplitConfig(profiles=("H100-PCIe", "H100-PCIe")), "profiles repeats H100-PCIe: give each once"),
    (lambda: StrategiesConfig(devices=("cpu@64", "cpu", "cpu")), "devices repeats cpu: give each once"),
    # study 1's own check said "strategies and seeds must not repeat", not which
    (lambda: StrategiesConfig(strategies=("full", "lora", "full")), "strategies repeats full: give each once"),
    (lambda: StrategiesConfig(seeds=(0, 1, 1, 0)), "seeds repeats 1, 0: give each once"),
])
def test_a_list_setting_that_repeats_a_value_is_one_line(make, said):
    """Study 1 refused repeated strategies; a repeated rung, k, profile or device was run twice (two rows
    of one name in a table), or tried again after it had failed."""
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}$"):
        make()
    assert LadderConfig(rungs=("fp32", "bf16")).rungs == ("fp32", "bf16")
    assert StrategiesConfig(devices=("cpu@64", "cpu")).devices == ("cpu@64", "cpu")


def test_an_unknown_keyword_names_what_the_config_has_however_it_is_built():
    """`StrategiesConfig(foo=1)` was Python's TypeError without the config's names (from_dict gave them),
    and a key that is not a string ended from_dict in "sequence item 0: expected str instance"."""
    import copy
    import pickle

    for make in (lambda: StrategiesConfig(toke_budget=20_000), lambda: StrategiesConfig.from_dict({"toke_budget": 1})):
        with pytest.raises(ConfigError, match=r"^unknown parameter for StrategiesConfig: toke_budget\. Known: model, "):
            make()
    with pytest.raises(ConfigError, match=r"^unknown parameters for LadderConfig: 1, foo\. Known: "):
        LadderConfig.from_dict({1: 2, "foo": 3})
    cfg = StrategiesConfig(seeds=(0, 1))  # what builds a config without keywords still does
    assert pickle.loads(pickle.dumps(cfg)) == copy.deepcopy(cfg) == cfg.replace(lr=cfg.lr) == cfg


def test_study_3s_modelled_sweep_is_as_many_runs_as_its_names_tell_apart():
    """modelled_k_points=10**9 was taken (a billion modelled runs); past 101 the runs' names, k to two
    decimals, repeat."""
    from workbench.studies.split.runner import modelled_runs

    for bad in (1, 102, 10**9):
        with pytest.raises(ConfigError, match=rf"^modelled_k_points must be 2 to 101 .*, got {bad}$"):
            SplitConfig(modelled_k_points=bad)
    rows, _ = modelled_runs(SplitConfig(profiles=("A100-80GB-SXM",), modelled_k_points=101, alpha=0.1), {})
    static = [r["run"] for r in rows if r["mode"] in ("static", "host only (k=0)")]
    assert len(static) == len(set(static)) == 101
