"""Confidence calibration maps: raw drafter confidences -> calibrated survival.

A map is applied by the simulator (and the ``confidence`` policies) before
scheduling. The identity map is the default until a fitted map is given with
``run --calibration PATH`` or referenced from a trace's metadata.

File format (TOML)::

    [calibration]
    method = "temperature"        # "identity" | "temperature" | "isotonic"
    drafter = "dspark"            # informational; checked against the trace when set
    gamma = 7
    temperatures = [1.3, 1.5, ...] # per draft position (sequential temperature scaling)

    # isotonic: one monotone piecewise-linear map per position
    [[calibration.isotonic]]
    x = [0.0, 0.5, 1.0]
    y = [0.0, 0.4, 0.97]

Temperature scaling acts on the logit of each conditional confidence:
``c' = sigmoid(logit(c) / T_k)``; survival is the cumulative product along the block.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark_sim.errors import InputError, check_known_keys
from dspark_sim.io import loads_toml, not_a_file, write_text_atomic

METHODS = ("identity", "temperature", "isotonic")
MAP_KEYS = ("method", "drafter", "gamma", "temperatures", "isotonic")
_EPS = 1e-6


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _EPS, 1.0 - _EPS)
    return np.log(p) - np.log1p(-p)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp overflows to inf for x below ~-709 (a tiny temperature): 1 / inf is the right 0,
    # but numpy printed an overflow warning on stderr beside the command's output
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


@dataclass(frozen=True, eq=False)
class CalibrationMap:
    method: str = "identity"
    temperatures: np.ndarray | None = None  # [gamma]
    iso_x: tuple[np.ndarray, ...] = field(default_factory=tuple)
    iso_y: tuple[np.ndarray, ...] = field(default_factory=tuple)
    drafter: str = ""
    source: str = "<identity>"

    @property
    def is_identity(self) -> bool:
        return self.method == "identity"

    def apply(self, conf: np.ndarray) -> np.ndarray:
        """Calibrated conditional confidences, same shape as ``conf`` ([n, gamma])."""
        conf = np.asarray(conf, dtype=np.float64)
        if self.method == "identity":
            return conf
        g = conf.shape[-1]
        if self.method == "temperature":
            t = self._per_position(self.temperatures, g)
            with np.errstate(over="ignore"):  # a tiny temperature: logit / t is +-inf
                return _sigmoid(_logit(conf) / t)
        out = np.empty_like(conf)
        for k in range(g):
            j = min(k, len(self.iso_x) - 1)
            out[..., k] = np.interp(conf[..., k], self.iso_x[j], self.iso_y[j])
        return out

    def survival(self, conf: np.ndarray) -> np.ndarray:
        """Prefix survival a_{r,j} = prod_{i<=j} c'_{r,i}. Rows of a 2-D ``conf`` are
        done ``SURVIVAL_ROWS`` at a time: a large trace's float64 intermediates (its
        confidences widened, calibrated) then stay a block's, not the trace's."""
        if np.ndim(conf) < 2:
            return np.cumprod(self.apply(conf), axis=-1)
        out = np.empty(np.shape(conf), np.float64)
        for lo in range(0, len(conf), SURVIVAL_ROWS):
            rows = slice(lo, lo + SURVIVAL_ROWS)
            np.cumprod(self.apply(conf[rows]), axis=-1, out=out[rows])
        return out

    @staticmethod
    def _per_position(t: np.ndarray, g: int) -> np.ndarray:
        # Positions past the fitted block reuse the last temperature.
        if len(t) >= g:
            return t[:g]
        return np.concatenate([t, np.full(g - len(t), t[-1])])

    def to_toml(self) -> str:
        lines = ["[calibration]", f'method = "{self.method}"', f'drafter = "{self.drafter}"']
        if self.temperatures is not None:
            lines.append(f"gamma = {len(self.temperatures)}")
            lines.append("temperatures = [" + ", ".join(repr(float(x)) for x in self.temperatures) + "]")
        for x, y in zip(self.iso_x, self.iso_y, strict=True):
            lines += ["", "[[calibration.isotonic]]",
                      "x = [" + ", ".join(repr(float(v)) for v in x) + "]",
                      "y = [" + ", ".join(repr(float(v)) for v in y) + "]"]
        return "\n".join(lines) + "\n"

    def save(self, path: str | Path) -> Path:
        return write_text_atomic(path, self.to_toml())


IDENTITY = CalibrationMap()
SURVIVAL_ROWS = 1 << 15

# Public names for the transforms the maps use (fitting code shares them).
logit = _logit
sigmoid = _sigmoid


def temperature_map(temperatures, drafter: str = "", source: str = "<fitted>") -> CalibrationMap:
    """A validated sequential-temperature map (one temperature per draft position)."""
    t = np.asarray(temperatures, dtype=np.float64)
    if t.ndim != 1 or t.size == 0 or not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise InputError(source, "temperatures must be a non-empty list of positive numbers")
    return CalibrationMap("temperature", temperatures=t, drafter=drafter, source=source)


def isotonic_map(xs, ys, drafter: str = "", source: str = "<fitted>") -> CalibrationMap:
    """A validated isotonic map: per position, monotone knots ``x -> y`` in [0, 1]."""
    rows_x, rows_y = [], []
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        x = np.asarray(x, float)
        y = np.asarray(y, float)
        _check_iso_row(source, i, x, y)
        rows_x.append(x)
        rows_y.append(y)
    if not rows_x:
        raise InputError(source, "isotonic map needs at least one position")
    return CalibrationMap("isotonic", iso_x=tuple(rows_x), iso_y=tuple(rows_y), drafter=drafter,
                          source=source)


def _check_iso_row(source: str, i: int, x: np.ndarray, y: np.ndarray) -> None:
    if x.ndim != 1 or x.size < 2 or x.shape != y.shape:
        raise InputError(source, f"isotonic row {i}: x and y need the same length, at least 2")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise InputError(source, f"isotonic row {i}: knots must be finite numbers (no NaN/inf)")
    if np.any(np.diff(x) < 0) or np.any(np.diff(y) < 0):
        raise InputError(source, f"isotonic row {i}: x and y must be non-decreasing")
    if y.min() < 0 or y.max() > 1:
        raise InputError(source, f"isotonic row {i}: y must lie in [0, 1]")


def _numbers(source: str, what: str, value) -> np.ndarray:
    """A TOML list of numbers as a float array; anything else is a one-line error."""
    if not isinstance(value, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value):
        raise InputError(source, f"{what} must be a list of numbers, got {value!r}")
    return np.asarray(value, dtype=np.float64)


def builtin_calibrations() -> list[str]:
    from importlib import resources

    root = resources.files("dspark_sim.calibration") / "data" / "calibration"
    if not root.is_dir():
        return []
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def load_calibration(path: str | Path | None) -> CalibrationMap:
    """A map from a TOML path, a built-in name (``calibration/data/calibration/``), or
    ``None`` / ``"identity"`` / ``"none"`` for the identity map."""
    if path is None or str(path) in ("identity", "none"):
        return IDENTITY
    source = str(path)
    p = Path(path)
    if not p.is_file() and p.suffix.lower() != ".toml" and source in builtin_calibrations():
        from importlib import resources

        res = resources.files("dspark_sim.calibration") / "data" / "calibration" / f"{source}.toml"
        text = res.read_text()
        source = f"builtin:{source}"
    elif not p.is_file():
        raise InputError(source, not_a_file(p, "calibration map"))
    else:
        try:
            text = p.read_text(encoding="utf-8-sig")  # a BOM is not TOML
        except UnicodeDecodeError as exc:
            raise InputError(source, "not a text file") from exc
    try:
        data = loads_toml(text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(source, f"invalid TOML: {exc}") from exc
    return _from_table(data.get("calibration"), source)


def _from_table(cal, source: str) -> CalibrationMap:
    """A map from the ``[calibration]`` table, every value type-checked (one definition of
    what a valid map is: :func:`temperature_map` / :func:`isotonic_map`)."""
    if not isinstance(cal, dict):
        raise InputError(source, "missing [calibration] table")
    # a misspelt key would be ignored: "methd" an identity map, "temperaturs" unread
    check_known_keys(f"{source} [calibration]", cal, MAP_KEYS)
    method = cal.get("method", "identity")
    if method not in METHODS:
        raise InputError(source, f"method must be one of {METHODS}, got {method!r}")
    drafter = cal.get("drafter", "")
    if not isinstance(drafter, str):
        raise InputError(source, f"drafter must be a string, got {drafter!r}")
    gamma = cal.get("gamma")
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, int)
                              or gamma < 1):
        raise InputError(source, f"gamma must be a positive integer, got {gamma!r}")
    if method == "temperature":
        temps = _numbers(source, "temperatures", cal.get("temperatures", []))
        if gamma is not None and gamma != temps.size:  # what to_toml writes: the two agree
            raise InputError(source, f"gamma = {gamma} but {temps.size} temperatures")
        return temperature_map(temps, drafter, source)
    if method == "isotonic":
        rows = cal.get("isotonic", [])
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
            raise InputError(source, "isotonic map needs [[calibration.isotonic]] rows")
        return isotonic_map([_numbers(source, f"isotonic row {i} x", r.get("x"))
                             for i, r in enumerate(rows)],
                            [_numbers(source, f"isotonic row {i} y", r.get("y"))
                             for i, r in enumerate(rows)], drafter, source)
    return CalibrationMap(drafter=drafter, source=source)
