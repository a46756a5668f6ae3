"""Settings of Maru's LMCache backend, read from LMCache's ``extra_config`` (its YAML file).

Every key starts with ``maru_``; a misspelt ``maru_*`` key is an error that lists the valid ones
(a silently ignored option would run with a default the operator did not choose). The meaning of
each key is in docs/lmcache.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from maru.config import DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_SERVER_URL
from maru.errors import ConfigError

# The plugin name LMCache's YAML lists under ``storage_plugins`` (docs/lmcache.md).
PLUGIN_NAME = "maru"


@dataclass(frozen=True)
class LMCacheMaruConfig:
    """The backend's options; defaults are what an unconfigured backend does."""

    server_url: str = DEFAULT_SERVER_URL
    namespace: str = ""
    timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    verify_on_get: bool = True
    max_pending_puts: int = 4096
    retry_s: float = 10.0
    register_with_cuda: bool = True
    zero_copy_get: bool = False

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> LMCacheMaruConfig:
        """Read ``maru_<field>`` keys of LMCache's ``extra_config``; other keys are LMCache's own."""
        extra = dict(extra or {})
        valid = {f"maru_{f.name}": f for f in fields(cls)}
        unknown = sorted(k for k in extra if k.startswith("maru_") and k not in valid)
        if unknown:
            raise ConfigError(
                f"unknown LMCache extra_config keys {unknown}; Maru's backend reads {sorted(valid)} "
                "(docs/lmcache.md)"
            )
        values: dict[str, Any] = {}
        for key, f in valid.items():
            if key not in extra:
                continue
            raw = extra[key]
            default = f.default
            try:
                if isinstance(default, bool):
                    values[f.name] = _as_bool(raw)
                elif isinstance(default, int):
                    values[f.name] = int(raw)
                elif isinstance(default, float):
                    values[f.name] = float(raw)
                else:
                    values[f.name] = str(raw)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"LMCache extra_config {key}={raw!r}: {e}") from None
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the key and value that cannot work."""
        if self.timeout_s <= 0:
            raise ConfigError(f"maru_timeout_s must be > 0, got {self.timeout_s}")
        if self.retry_s <= 0:
            raise ConfigError(f"maru_retry_s must be > 0, got {self.retry_s}")
        if self.max_pending_puts < 1:
            raise ConfigError(f"maru_max_pending_puts must be >= 1, got {self.max_pending_puts}")
        if "/" in self.namespace:
            raise ConfigError(f"maru_namespace must not contain '/', got {self.namespace!r}")


def _as_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {v!r}")
