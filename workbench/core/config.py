"""Validated, frozen configs: the one place parameters become settings.

Every study, notebook and CLI builds its settings through a subclass of `Config`:

    cfg = StrategiesConfig.from_dict({"token_budget": 20_000, "seeds": [0, 1]})

Unknown names and wrong types are errors (papermill only warns about unknown parameters), and
`__post_init__` of each subclass rejects contradictory or out-of-range values. Each field carries
its help text in `metadata["help"]`, which the CLI and the widget panels show.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from workbench.core.data import CorpusError, check_has_text


class ConfigError(ValueError):
    """A parameter name, type or value that the workbench will not run with."""


def param(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with a one-line help text (shown by the CLI and the knobs)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple default for sequences; configs are frozen")
    return dataclasses.field(default=default, metadata={"help": help, **kw})


# The shared vocabulary: a setting that means the same thing has one name, one type and one help
# text in every study's config (and so in every notebook, knob and command line). A study declares
# one with `setting(name, default, note)`; tests/test_config.py holds that each study's field of a
# vocabulary name has the vocabulary's type.
VOCABULARY: dict[str, tuple[Any, str]] = {
    "model": (str, "model: 'embedded' (the built-in base), a Hugging Face id or a local model directory"),
    "base_size": (Literal["default", "tiny"], "embedded base: 'default' or 'tiny' (tests; builds in about 10 s)"),
    "corpus": (str, "target text: 'embedded' (Python's language reference) or a text file or folder"),
    "seq_len": (int, "tokens per sequence"),
    "micro_batch": (int, "sequences per forward/backward pass"),
    "grad_accum": (int, "micro-batches per optimizer step"),
    "steps": (int, "optimizer steps per run"),
    "lr": (float, "peak learning rate"),
    "seed": (int, "random seed"),
    "precision": (Literal["fp32", "bf16", "fp16"], "compute precision: fp32, bf16 or fp16"),
    "threads": (int, "torch threads (0: leave as set)"),
    "device": (Literal["auto", "cpu", "cuda"], "device: auto (cuda if present, else cpu), cpu or cuda"),
    "eval_blocks": (int, "held-out blocks scored for perplexity"),
    "lora_rank": (int, "rank of the LoRA adapters"),
    "trust_remote_code": (bool, "let transformers run a hub repository's own code, its tokenizer's (off: safer); "
                                  "an architecture of its own is refused: the studies build transformers' own"),
}


# The least value a vocabulary setting can take in any study, and why (checked with the types).
LEAST: dict[str, tuple[int, str]] = {
    "seq_len": (2, "a block of one token has no next token to predict"),
}


# torch.manual_seed takes integers in [-2**63, 2**64); a seed past that passed the settings and ended the job in
# a traceback ("Overflow when unpacking long long"). A workbench seed is one torch takes that a results
# table's int64 column also holds: 0 to 2**63 - 1.
SEED_MAX = 2**63 - 1


def check_seed(name: str, seed: int) -> None:
    """A seed outside 0..2**63 - 1 is a one-line error as the settings are made, not a traceback in the run."""
    if not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"{name}: {seed} is not a seed a run takes; use an integer from 0 to 2**63 - 1 "
                          "(torch.manual_seed's range that a results table's int64 column holds), e.g. 0")


def check_no_repeats(name: str, values) -> None:
    """A list setting that names a value twice is a one-line error: a rung measured twice, a k run twice,
    a device tried again after it failed, each a table with two rows of one name."""
    repeated = list(dict.fromkeys(v for i, v in enumerate(values) if v in values[:i]))
    if repeated:
        raise ConfigError(f"{name} repeats {', '.join(map(str, repeated))}: give each once")


def check_scheduler(address: str, name: str = "scheduler") -> None:
    """A Dask scheduler address that is none ('notanaddress': no port) is a one-line error as the settings
    are made, not after the embedded base was built; whether it can be reached is said when the runs begin."""
    from distributed.comm import parse_address
    from distributed.comm.addressing import parse_host_port

    try:
        scheme, location = parse_address(address)
        if scheme in ("tcp", "tls"):
            parse_host_port(location)
    except ValueError as e:
        raise ConfigError(f"{name}: {address!r} is not a Dask scheduler address ({e}); give its address, e.g. "
                          "tls://HOST:8786 or tcp://HOST:8786") from None


def check_corpus(corpus: str) -> None:
    """A `corpus` path that does not exist, or holds no text to split, is a one-line error as the settings
    are made (it was one after minutes: study 1 builds the embedded base first)."""
    if not corpus or corpus == "embedded":  # (as data.target_corpus reads it: pydoc's language reference)
        return
    if not Path(corpus).expanduser().exists():
        raise ConfigError(f"corpus {corpus!r} does not exist; give a text file, a folder of them, or 'embedded' "
                          "(Python's language reference)")
    try:
        check_has_text(corpus)
    except CorpusError as e:
        raise ConfigError(str(e)) from e


def setting(name: str, default: Any, note: str = "") -> Any:
    """A field of the shared vocabulary: its help text, plus what it means in this study (`note`)."""
    if name not in VOCABULARY:
        raise KeyError(f"{name!r} is not in the shared vocabulary: {', '.join(VOCABULARY)}")
    return param(default, VOCABULARY[name][1] + (f"; {note}" if note else ""), setting=name)


# Names a notebook namespace holds that are not parameters.
_NOTEBOOK_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}


def _got(value: Any) -> str:
    """What was given, for an error: `NAME=` (YAML's null) said as such, not as 'NoneType None'."""
    return "nothing (an empty value, or null)" if value is None else f"{type(value).__name__} {value!r}"


def _check_type(name: str, value: Any, tp: Any) -> Any:
    """Return `value` coerced to `tp` where that is lossless, else raise ConfigError."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check_type(name, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # Optional[X]: X's own reason ("expected a finite number, got inf")
            raise ConfigError(f"{errors[0]} (or None)")
        raise ConfigError(f"{name}: {value!r} is not {_type_name(tp)}")
    if origin is typing.Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"{name}: {value!r} is not one of {list(get_args(tp))}")
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {_got(value)}")
        args = get_args(tp)
        item = args[0] if args else Any
        return tuple(_check_type(f"{name}[{i}]", v, item) for i, v in enumerate(value))
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected a number, got {_got(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{name}: expected a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            # a float counts as an integer only where it is one exactly (2**53: a float's last
            # exact integer); 1e99 is a typo, not a step count
            if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
                return int(value)
            raise ConfigError(f"{name}: expected an integer, got {_got(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {_got(value)}")
        return value
    if tp is str:
        if value is None:  # `NAME=` on a command line or in a grid: YAML reads an empty value as null
            return ""
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {_got(value)}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{name}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


@dataclasses.dataclass(frozen=True)
class Config:
    """Base of every workbench config. Subclasses are frozen dataclasses made of `param`s.

    Every field is type-checked (and coerced where lossless: a list to a tuple, 3 to 3.0) when
    the config is built, however it is built: through `from_dict`, or directly as
    `StrategiesConfig(lr=float("nan"))`. A subclass's own `__post_init__` (its range and
    consistency checks) runs after the type checks; `__init_subclass__` chains the two, so a
    subclass cannot forget to call the base.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        # an unknown keyword was Python's TypeError ("__init__() got an unexpected keyword argument"),
        # without the names a config has, which from_dict gives
        cls._check_names(kwargs)
        return super().__new__(cls)

    @classmethod
    def _check_names(cls, names) -> None:
        known = cls.fields()
        unknown = sorted(map(str, set(names) - set(known)))
        if unknown:
            raise ConfigError(f"unknown parameter{'s' if len(unknown) > 1 else ''} for {cls.__name__}: "
                              f"{', '.join(unknown)}. Known: {', '.join(known)}")

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            checked = _check_type(f.name, value, hints[f.name])
            if checked is not value:
                object.__setattr__(self, f.name, checked)
            if f.metadata.get("setting") == "seed":
                check_seed(f.name, checked)
            least = LEAST.get(f.metadata.get("setting"))
            if least is not None and checked < least[0]:
                raise ConfigError(f"{f.name} must be at least {least[0]} ({least[1]}), got {checked}")

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        own = cls.__dict__.get("__post_init__")
        if own is not None and not getattr(own, "_chained", False):
            def post_init(self, _own=own) -> None:
                Config.__post_init__(self)
                _own(self)

            post_init._chained = True  # type: ignore[attr-defined]
            functools.update_wrapper(post_init, own)
            cls.__post_init__ = post_init

    @classmethod
    def fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    @classmethod
    def help(cls) -> dict[str, str]:
        return {n: f.metadata.get("help", "") for n, f in cls.fields().items()}

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None = None, **overrides: Any):
        values = {**(values or {}), **overrides}
        cls._check_names(values)  # here too: a key that is not a string never reaches __new__
        return cls(**values)  # __post_init__ checks each value's type

    @classmethod
    def from_namespace(cls, namespace: dict[str, Any]):
        """Build from a notebook's globals: every plain value defined there is a parameter.

        The parameters cell and papermill's injected cell are the only cells that define plain
        values before this call, so a misspelt injected parameter is an unknown name here. What the
        notebook's own cells make from the config (`cfg`, its live chart, its result: workbench
        objects, never parameters) is left out: when the cells run again in the same kernel (Run
        All after editing a parameter) they are still there, and were refused as unknown names.
        """
        values = {
            k: v
            for k, v in namespace.items()
            if not k.startswith("_")
            and k not in _NOTEBOOK_NAMES
            and not isinstance(v, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType))
            and not callable(v)
            and type(v).__module__.partition(".")[0] != "workbench"
        }
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def knob_values(self) -> dict[str, Any]:
        """What a knobs panel starts from: to_dict(), where a subclass gives back a default it resolved
        from other fields unresolved, so it follows them when they change on the panel."""
        return self.to_dict()

    def replace(self, **changes: Any):
        return type(self).from_dict({**self.to_dict(), **changes})

    def hash(self) -> str:
        """A short stable key of the settings (used to skip finished runs)."""
        blob = json.dumps({"type": type(self).__name__, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, Config):
        return v.to_dict()
    return v
