"""Typed backend options with environment defaults.

Every option has one declaration below: its type, default, environment variable and meaning.
Values come, lowest priority first, from the declared default, the environment, `patch()`,
and the `options=` dict passed to `torch.compile`. An unknown option or a bad value raises a
`ConfigError` that says what is accepted. `NeuronConfig.cache_hash()` keys compiled graphs, so
only options that change generated code take part in it. A secret option (`cache_secret`) is left
out of the repr and shown as "<set>" by `as_dict()` (what dumps record), so it reaches no file or log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


class ConfigError(ValueError):
    """A backend option or environment flag has an invalid name or value."""


def _choice(*allowed: str) -> Callable[[str, Any], str]:
    def parse(name: str, value: Any) -> str:
        text = str(value).strip().lower()
        if text not in allowed:
            raise ConfigError(f"option {name}={value!r} is not valid; accepted values: {', '.join(allowed)}")
        return text

    parse.accepted = allowed  # type: ignore[attr-defined]
    return parse


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"option {name}={value!r} is not a boolean; accepted values: 1/0, true/false, yes/no, on/off")


def _optional_path(name: str, value: Any) -> str | None:
    if value is None or str(value).strip() == "":
        return None
    return os.path.expanduser(str(value))


def _optional_secret(name: str, value: Any) -> str | None:
    return None if value is None or str(value) == "" else str(value)


def _verify_mode(name: str, value: Any) -> str:
    """NEURON_INDUCTOR_VERIFY accepts 1 as a synonym for 'warn' and 0 for 'off'."""
    text = str(value).strip().lower()
    text = {"1": "warn", "true": "warn", "0": "off", "false": "off", "": "off"}.get(text, text)
    return _choice("off", "warn", "raise")(name, text)


def _bucket_policy(name: str, value: Any) -> str:
    # Parsed for validity here; bucketing.BucketPolicy owns the meaning.
    from .bucketing import BucketPolicy

    try:
        return BucketPolicy.parse(str(value)).spec
    except ValueError as exc:
        raise ConfigError(f"option {name}={value!r}: {exc}") from None


def _option(default: Any, env: str | None, parse: Callable[[str, Any], Any], doc: str, *, codegen: bool,
            secret: bool = False) -> Any:
    return field(default=default, repr=not secret,
                 metadata={"env": env, "parse": parse, "doc": doc, "codegen": codegen, "secret": secret})


@dataclass(frozen=True)
class NeuronConfig:
    toolchain: str = _option(
        "auto", "NEURON_INDUCTOR_TOOLCHAIN", _choice("auto", "simulator", "neuron"),
        "Where kernels compile and run: the built-in NKI interpreter ('simulator'), the real nki.jit "
        "('neuron', needs a Neuron host), or 'auto' (neuron when the real nki imports and a device exists).",
        codegen=True)
    target: str = _option(
        "trn2", "NEURON_INDUCTOR_TARGET", _choice("trn1", "trn2", "trn3"),
        "Hardware generation the kernels are planned for (tile sizes, SBUF and PSUM budgets) and whose limits "
        "they obey (the interpreter checks and runs them with its rules and capacities), and whose cost model "
        "estimates time.",
        codegen=True)
    fallback: str = _option(
        "warn", "NEURON_INDUCTOR_FALLBACK", _choice("warn", "allow", "error"),
        "Ops without a lowering run as eager ATen calls: 'warn' logs each once, 'allow' only counts them, "
        "'error' raises one error listing every unsupported op of the graph.",
        codegen=True)
    buckets: str = _option(
        "128", "NEURON_INDUCTOR_BUCKETS", _bucket_policy,
        "Static-shape bucket policy for dynamic dims: 'N' (next multiple of N), '128,256,512' (sorted list), "
        "'128:4096' (multiples of 128 up to 4096, then powers of two), or 'off' (exact shapes).",
        codegen=True)
    cache_dir: str | None = _option(
        None, "NEURON_INDUCTOR_CACHE_DIR", _optional_path,
        "Disk cache of compiled graphs (default: ~/.cache/neuron_inductor).", codegen=False)
    cache_secret: str | None = _option(
        None, "NEURON_INDUCTOR_CACHE_SECRET", _optional_secret,
        "Key of an authenticated cache: every disk entry carries an HMAC-SHA256 under it, and an entry "
        "without a valid one is rebuilt, never run. Needed to share a cache folder that others can write "
        "(ranks, pods, users); never part of cache keys, dumps or logs.", codegen=False, secret=True)
    dump_dir: str | None = _option(
        None, "NEURON_INDUCTOR_DUMP_DIR", _optional_path,
        "Write, per compiled graph and bucket, the graphs, every kernel's NKI source, the host wrapper, "
        "the cache-key parts and report.json under this folder.", codegen=False)
    verify: str = _option(
        "off", "NEURON_INDUCTOR_VERIFY", _verify_mode,
        "On the first run of each bucket compare with eager on the unpadded inputs: 'off', 'warn' (or 1), 'raise'.",
        codegen=False)
    fuse_lm_head_loss: bool = _option(
        True, "NEURON_INDUCTOR_FUSE_LM_HEAD_LOSS", _flag,
        "Fuse the LM head matmul with its cross-entropy (passes/lm_head_loss.py): the [N, V] logits are made "
        "one on-chip tile at a time and never stored whole (0 keeps the unfused matmul + loss kernels).",
        codegen=True)
    raise_recompile_limit: bool = _option(
        True, "NEURON_INDUCTOR_RAISE_RECOMPILE_LIMIT", _flag,
        "Raise Dynamo's recompile limit so that every configured bucket fits (0 keeps Dynamo's limit).",
        codegen=False)

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def replace(self, **changes: Any) -> "NeuronConfig":
        return dataclasses.replace(self, **_parse_options(changes))

    def cache_hash(self) -> str:
        """Hash of the options that change generated code (part of every cache key)."""
        relevant = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["codegen"]}
        return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]

    def as_dict(self) -> dict[str, Any]:
        """Every option; a secret one as "<set>" or None."""
        values = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.metadata["secret"] and values[f.name] is not None:
                values[f.name] = "<set>"
        return values


_FIELDS = {f.name: f for f in dataclasses.fields(NeuronConfig)}
_patches: list[dict[str, Any]] = []


def _parse_options(options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"unknown neuron_inductor option(s) {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(NeuronConfig.option_names())}")
    return {name: _FIELDS[name].metadata["parse"](name, value) for name, value in options.items()}


def env_defaults() -> dict[str, Any]:
    """Option values set through environment variables (parsed and validated)."""
    values = {}
    for name, f in _FIELDS.items():
        env = f.metadata["env"]
        if env and env in os.environ:
            try:
                values[name] = f.metadata["parse"](name, os.environ[env])
            except ConfigError as exc:
                raise ConfigError(f"environment variable {env}: {exc}") from None
    return values


def resolve(options: dict[str, Any] | None = None) -> NeuronConfig:
    """The effective config: defaults < environment < patch() < options."""
    values = env_defaults()
    for patch_values in _patches:
        values.update(patch_values)
    if options:
        if not isinstance(options, dict):
            raise ConfigError(f"options must be a dict, got {type(options).__name__}")
        values.update(_parse_options(options))
    return NeuronConfig(**values)


@contextlib.contextmanager
def patch(**options: Any) -> Iterator[None]:
    """Override options for the code inside the block (tests, benchmarks)."""
    _patches.append(_parse_options(options))
    try:
        yield
    finally:
        _patches.pop()


def describe_options() -> list[tuple[str, str | None, Any, str]]:
    """(name, env var, default, doc) for every option: the README table and `--help` come from here."""
    return [(f.name, f.metadata["env"], f.default, f.metadata["doc"]) for f in dataclasses.fields(NeuronConfig)]
