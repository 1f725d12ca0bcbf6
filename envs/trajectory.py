"""The record of one episode: `Trajectory`, its `TurnSpan`s and its per-step `StepInfo`s.

This is a leaf module (numpy only): `envs/` produces these records, `rewards/` reads them and `rl/`
stores and trains on them, so all three import it from here and no arrow points up. The Arrow codec
and the on-disk store live in rl/trajectory.py (which re-exports these names).

A `Trajectory` holds the exact token ids the policy saw and produced (prompt, assistant
turns, tool observations, concatenated in order), with per-token training data:

    tokens            int32   [T]                  every token of the episode, in order
    loss_mask         uint8   [T]                  1 on model-generated tokens, else 0
    rollout_logprobs  float32 [T]                  behaviour-policy log-prob, NaN where not generated
    routed_experts    uint16  [T, n_moe_layers, k] top-k expert ids per MoE layer (routing replay), optional
    token_versions    int32   [T]                  policy version that sampled each generated token, -1 on
                                                   other tokens; optional (None in stores before schema 3)

plus turn spans, one `StepInfo` per env step, rewards and metadata, and the images the policy saw:

    images            dict[str, bytes]             content-addressed PNGs: sha256 hex digest -> bytes
    image_spans       list[ImageSpan]              where each image's token block sits: tokens [start, end)
                                                   (always inside one prompt or observation turn), its image
                                                   (sha256) and its patch grid (grid_h, grid_w)

The record checks the structure (digests, spans inside non-assistant turns, every image used); that the
tokens of a span are exactly the image block of its grid is the model's layout (model/vision.py), checked
where the model is known (rl/trajectory.py `check_image_tokens`, on store read-back and in the learner).

Assistant turn i is the i-th span with role "assistant"; `step_infos[i]` (when it exists) is the env step
that consumed that turn's text. See docs/trajectory.md.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

ROLES = ("prompt", "assistant", "observation")


@dataclass(eq=False)
class StepInfo(MutableMapping):
    """What one `env.step` reported (envs/base.py, "Step info"); `Trajectory.step_infos[i]` is assistant
    turn i's.

        tool_calls    every call whose JSON parsed: {"name", "arguments"} (valid or not)
        tool_results  one per tool_calls entry, same order: the tool's output, or its error text
        tool_errors   every problem this turn (parse errors included), without the "error: " prefix
        subgoals      sub-goals first achieved at this step
        env_reward    the reward step returned (the success score at termination, else 0.0)
        infra_error   set when a SandboxError or the env's own code ended the episode (never the agent)
        turn          1-based index of this step in the episode (None when the step never ran)
        no_tool_call  the turn held no tool call at all
        success       only when the env terminated the episode itself, else None
        extra         any other key an env reported (JSON-serialisable to be stored)

    Stored as a plain dict (`to_dict`: the fields, `success` only when set, then the extra keys at top
    level), so the stored form is the gymnasium info dict. For code written against those dicts a
    StepInfo also reads and writes like one: `info["tool_errors"]`, `info.get("success")`, `"success" in
    info` (False while it is None), `info["my_key"] = 1` (goes to `extra`), and it equals the dict.
    """

    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_results: list[str] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    subgoals: list[str] = field(default_factory=list)
    env_reward: float = 0.0
    infra_error: str | None = None
    turn: int | None = None
    no_tool_call: bool = False
    success: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the common case (plain lists of str / dicts, a float) is only checked, not copied: records are
        # built for every stored step when a store is read
        for name in ("tool_results", "tool_errors", "subgoals"):
            v = getattr(self, name)
            if type(v) is not list or not all(type(x) is str for x in v):
                setattr(self, name, _str_list(name, v))
        if type(self.tool_calls) is not list or not all(type(c) is dict for c in self.tool_calls):
            if not isinstance(self.tool_calls, (list, tuple)) or not all(
                isinstance(c, Mapping) for c in self.tool_calls
            ):
                got = repr(self.tool_calls)
                raise TypeError(f"StepInfo.tool_calls must be a list of {{name, arguments}} dicts, got {got}")
            self.tool_calls = [dict(c) for c in self.tool_calls]
        self.env_reward = _finite("env_reward", self.env_reward)
        if self.infra_error is not None and type(self.infra_error) is not str:
            self.infra_error = str(self.infra_error)
        if self.turn is not None and type(self.turn) is not int:
            if isinstance(self.turn, bool) or not isinstance(self.turn, np.integer):
                raise TypeError(
                    f"StepInfo.turn must be an int (1-based step index) or None, got {self.turn!r}"
                )
            self.turn = int(self.turn)
        self.no_tool_call = bool(self.no_tool_call)
        if self.success is not None:
            self.success = _finite("success", self.success)
        if type(self.extra) is not dict:
            raise TypeError(f"StepInfo.extra must be a dict, got {type(self.extra).__name__}")
        if self.extra and not _FIELD_SET.isdisjoint(self.extra):
            clash = sorted(_FIELD_SET.intersection(self.extra))
            raise ValueError(f"StepInfo.extra must not hold the record's own fields {clash}; set the fields")

    @classmethod
    def from_dict(cls, info: Mapping[str, Any]) -> StepInfo:
        """The record of an env's info dict: known keys become fields, every other key goes to `extra`."""
        if isinstance(info, StepInfo):
            return info
        if not isinstance(info, Mapping):
            raise TypeError(
                f"a step info must be a dict (the info env.step returned), got {type(info).__name__}"
            )
        known, extra = {}, {}
        for k, v in info.items():
            (known if k in _FIELD_SET else extra)[k] = v  # an env's own "extra" key goes to extra too
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The gymnasium info dict / stored JSON form: the fields (`success` only when set), then `extra`."""
        return {k: getattr(self, k) for k in self._present()} | self.extra

    # ---- dict-style access (code written against the plain info dicts keeps working) -----------------
    def _present(self) -> list[str]:
        return [k for k in _FIELDS if k != "success" or self.success is not None]

    def __getitem__(self, key: str) -> Any:
        if key in _FIELD_SET:
            if key == "success" and self.success is None:
                raise KeyError(key)
            return getattr(self, key)
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _FIELD_SET:
            setattr(self, key, value)
            self.__post_init__()  # coerce and check the new value like the constructor does
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if key == "success":
            if self.success is None:
                raise KeyError(key)
            self.success = None
        elif key in _FIELD_SET:
            raise KeyError(f"{key!r} is a StepInfo field and cannot be deleted; assign it instead")
        else:
            del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        yield from self._present()
        yield from self.extra

    def __len__(self) -> int:
        return len(self._present()) + len(self.extra)

    def __repr__(self) -> str:
        return f"StepInfo({self.to_dict()!r})"


_FIELDS = tuple(f.name for f in fields(StepInfo) if f.name != "extra")
_FIELD_SET = frozenset(_FIELDS)


def _str_list(name: str, x: Any) -> list[str]:
    if isinstance(x, str) or not isinstance(x, (list, tuple)):
        raise TypeError(f"StepInfo.{name} must be a list of str, got {type(x).__name__} {x!r}")
    return [str(s) for s in x]


def _finite(name: str, x: Any) -> float:
    if type(x) is float and math.isfinite(x):
        return x
    if (
        isinstance(x, bool)
        or not isinstance(x, (int, float, np.integer, np.floating))
        or not math.isfinite(x)
    ):
        raise TypeError(f"StepInfo.{name} must be a finite number, got {x!r}")
    return float(x)


@dataclass
class TurnSpan:
    """Tokens `[start, end)` of one message of the conversation; role in ROLES."""

    role: str
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ImageSpan:
    """Tokens `[start, end)` hold the block of image `sha256` (a key of `Trajectory.images`), a
    grid_h x grid_w patch grid."""

    sha256: str
    start: int
    end: int
    grid_h: int
    grid_w: int


@dataclass(eq=False)
class Trajectory:
    """One episode. Arrays are validated and coerced to the documented dtypes on construction.

    Shapes: tokens / loss_mask / rollout_logprobs [T]; routed_experts [T, n_moe_layers, k] or None;
    token_versions [T] or None (a partial rollout that spans weight updates has several versions).
    `turn_rewards` is empty until `rewards.compose` fills it (then len == number of assistant turns).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    rollout_logprobs: np.ndarray
    routed_experts: np.ndarray | None = None
    turns: list[TurnSpan] = field(default_factory=list)
    step_infos: list[StepInfo] = field(default_factory=list)
    outcome: float | None = None
    terminated: bool = False
    truncated: bool = False
    infra_error: str | None = None
    reward_error: str | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    turn_rewards: list[float] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    token_versions: np.ndarray | None = None
    images: dict[str, bytes] = field(default_factory=dict)
    image_spans: list[ImageSpan] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = _as_int_array("tokens", self.tokens, np.int32)
        if self.tokens.ndim != 1:
            raise ValueError(f"Trajectory.tokens must be 1-D [T], got shape {self.tokens.shape}")
        T = self.tokens.shape[0]
        self.loss_mask = _as_mask(self.loss_mask, T)
        self.rollout_logprobs = _as_float_array("rollout_logprobs", self.rollout_logprobs, T)
        if self.routed_experts is not None:
            re = _as_int_array("routed_experts", self.routed_experts, np.uint16)
            if re.ndim != 3 or re.shape[0] != T:
                raise ValueError(
                    f"Trajectory.routed_experts must have shape [T={T}, n_moe_layers, k], got {re.shape}; "
                    "pass None when the engine did not record routing"
                )
            self.routed_experts = re
        if self.token_versions is not None:
            tv = _as_int_array("token_versions", self.token_versions, np.int32)
            if tv.shape != (T,):
                raise ValueError(f"Trajectory.token_versions must have shape [T={T}], got {tv.shape}")
            self.token_versions = tv
        self.turns = [_as_span(i, s) for i, s in enumerate(self.turns)]
        _check_spans(self.turns, T)
        _check_mask_in_assistant_spans(self.loss_mask, self.turns)
        n_asst = self.n_assistant_turns
        if not isinstance(self.step_infos, list) or not all(isinstance(d, Mapping) for d in self.step_infos):
            raise TypeError(
                "Trajectory.step_infos must be a list of dicts or StepInfo records (one per env.step)"
            )
        self.step_infos = [StepInfo.from_dict(d) for d in self.step_infos]
        if len(self.step_infos) > n_asst:
            raise ValueError(
                f"Trajectory has {len(self.step_infos)} step_infos but only {n_asst} assistant turns; "
                "step_infos[i] belongs to assistant turn i, so there can be at most one per assistant turn"
            )
        if self.outcome is not None:
            self.outcome = float(self.outcome)
        if self.turn_rewards and len(self.turn_rewards) != n_asst:
            raise ValueError(
                f"Trajectory.turn_rewards has {len(self.turn_rewards)} entries, expected one per assistant "
                f"turn ({n_asst}) or none"
            )
        self.turn_rewards = [float(x) for x in self.turn_rewards]
        self.rewards = {str(k): float(v) for k, v in self.rewards.items()}
        if not isinstance(self.metadata, dict):
            raise TypeError(f"Trajectory.metadata must be a dict, got {type(self.metadata).__name__}")
        self.images, self.image_spans = _check_images(self.images, self.image_spans, self.turns, T)

    # ---- views -------------------------------------------------------------------------------
    @classmethod
    def empty(cls, metadata: dict[str, Any], infra_error: str | None = None, outcome: float | None = None
              ) -> Trajectory:
        """A terminated episode with no tokens (the policy never ran, or generated nothing): marked with
        `infra_error`, or scored `outcome`, so that its sample is still accounted for."""
        return cls(
            tokens=np.zeros(0, np.int32),
            loss_mask=np.zeros(0, np.uint8),
            rollout_logprobs=np.zeros(0, np.float32),
            routed_experts=None,
            turns=[],
            step_infos=[],
            outcome=outcome if infra_error is None else None,
            terminated=True,
            infra_error=infra_error,
            metadata=metadata,
        )

    @property
    def n_tokens(self) -> int:
        """T, the total number of tokens (prompt + generated + observations)."""
        return int(self.tokens.shape[0])

    @property
    def n_generated(self) -> int:
        """Number of model-generated tokens, sum(loss_mask)."""
        return int(np.count_nonzero(self.loss_mask))

    @property
    def n_assistant_turns(self) -> int:
        return sum(1 for s in self.turns if s.role == "assistant")

    @property
    def policy_version(self) -> int | None:
        v = self.metadata.get("policy_version")
        return None if v is None else int(v)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among the generated tokens (token_versions; else
        metadata["policy_version"], the version at the episode's start); None when unknown."""
        if self.token_versions is not None:
            gen = self.token_versions[self.loss_mask.astype(bool)]
            gen = gen[gen >= 0]
            if gen.size:
                return int(gen.min())
        return self.policy_version

    def assistant_spans(self) -> list[TurnSpan]:
        """The assistant turns, in order; index i matches step_infos[i] and turn_rewards[i]."""
        return [s for s in self.turns if s.role == "assistant"]

    def last_generated_index(self, span: TurnSpan | None = None) -> int | None:
        """Index of the last token with loss_mask == 1 (within `span` if given), or None if there is none."""
        lo, hi = (0, self.n_tokens) if span is None else (span.start, span.end)
        nz = np.flatnonzero(self.loss_mask[lo:hi])
        return None if nz.size == 0 else lo + int(nz[-1])


# ---- validation helpers -------------------------------------------------------------------------


def _as_int_array(name: str, x: Any, dtype: type) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == dtype:
        return a
    if a.size == 0:
        return a.astype(dtype)
    if a.dtype.kind not in "iu":
        raise TypeError(
            f"Trajectory.{name} must hold integers ({np.dtype(dtype).name}), got dtype {a.dtype}; "
            f"pass np.asarray(x, dtype=np.{np.dtype(dtype).name})"
        )
    info = np.iinfo(dtype)
    lo, hi = int(a.min()), int(a.max())
    if lo < info.min or hi > info.max:
        raise ValueError(
            f"Trajectory.{name} values must fit {np.dtype(dtype).name} [{info.min}, {info.max}], "
            f"got range [{lo}, {hi}]"
        )
    return a.astype(dtype)


def _as_mask(x: Any, T: int) -> np.ndarray:
    a = np.asarray(x)
    if a.shape != (T,):
        raise ValueError(f"Trajectory.loss_mask must have shape [T={T}], got {a.shape}")
    if a.dtype == np.bool_:
        return a.astype(np.uint8)
    a = _as_int_array("loss_mask", a, np.uint8)
    if a.size and a.max() > 1:
        raise ValueError("Trajectory.loss_mask must contain only 0 and 1 (1 = model-generated token)")
    return a


def _as_float_array(name: str, x: Any, T: int) -> np.ndarray:
    a = np.asarray(x)
    if a.shape != (T,):
        raise ValueError(f"Trajectory.{name} must have shape [T={T}], got {a.shape}")
    if a.dtype == np.float32:
        return a
    if a.size and a.dtype.kind != "f":
        raise TypeError(f"Trajectory.{name} must be floating point (float32), got dtype {a.dtype}")
    return a.astype(np.float32)


def _as_span(i: int, s: Any) -> TurnSpan:
    if isinstance(s, dict):
        s = TurnSpan(**s)
    if not isinstance(s, TurnSpan):
        raise TypeError(f"Trajectory.turns[{i}] must be a TurnSpan, got {type(s).__name__}")
    if s.role not in ROLES:
        raise ValueError(f"Trajectory.turns[{i}].role is {s.role!r}; expected one of {ROLES}")
    return TurnSpan(s.role, int(s.start), int(s.end))


def _check_spans(turns: list[TurnSpan], T: int) -> None:
    prev_end = 0
    for i, s in enumerate(turns):
        if not (0 <= s.start < s.end <= T):
            raise ValueError(
                f"Trajectory.turns[{i}] = {s} is empty or outside [0, T={T}); spans are [start, end) "
                "token ranges with start < end"
            )
        if s.start < prev_end:
            raise ValueError(
                f"Trajectory.turns[{i}] = {s} overlaps or precedes the previous span (ends {prev_end})"
            )
        prev_end = s.end


def _check_mask_in_assistant_spans(mask: np.ndarray, turns: list[TurnSpan]) -> None:
    inside = np.zeros(mask.shape, dtype=bool)
    for s in turns:
        if s.role == "assistant":
            inside[s.start : s.end] = True
    bad = np.flatnonzero(mask.astype(bool) & ~inside)
    if bad.size:
        raise ValueError(
            f"Trajectory.loss_mask is 1 at token {int(bad[0])} (and {bad.size - 1} more) outside every "
            "assistant span; only model-generated tokens (inside assistant turns) may be trained on"
        )


def _check_images(images: Any, spans: Any, turns: list[TurnSpan], T: int
                  ) -> tuple[dict[str, bytes], list[ImageSpan]]:
    """Validate the images and their spans (see the module docstring); returns them normalised."""
    if not isinstance(images, Mapping):
        raise TypeError(f"Trajectory.images must be a dict sha256 -> PNG bytes, got {type(images).__name__}")
    out: dict[str, bytes] = {}
    for key, data in images.items():
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"Trajectory.images[{str(key)[:16]}...] must be bytes, got {type(data).__name__}")
        data = bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        if key != digest:
            raise ValueError(f"Trajectory.images key {str(key)[:16]}... is not the sha256 of its bytes "
                             f"({digest[:16]}...): images are content-addressed; key each by sha256(bytes)")
        out[digest] = data
    norm: list[ImageSpan] = []
    holder = [(t.start, t.end) for t in turns if t.role != "assistant"]
    prev_end = 0
    for i, sp in enumerate(spans):
        if isinstance(sp, dict):
            sp = ImageSpan(**sp)
        if not isinstance(sp, ImageSpan):
            raise TypeError(f"Trajectory.image_spans[{i}] must be an ImageSpan, got {type(sp).__name__}")
        sp = ImageSpan(str(sp.sha256), int(sp.start), int(sp.end), int(sp.grid_h), int(sp.grid_w))
        if sp.sha256 not in out:
            raise ValueError(f"Trajectory.image_spans[{i}] refers to image {sp.sha256[:16]}... which is not "
                             "in Trajectory.images; store every image the spans use")
        if not (prev_end <= sp.start < sp.end <= T) or sp.grid_h < 1 or sp.grid_w < 1:
            raise ValueError(f"Trajectory.image_spans[{i}] = {sp} must be a non-empty token range inside "
                             f"[0, T={T}) after the previous span, with a grid of at least 1x1")
        if not any(a <= sp.start and sp.end <= b for a, b in holder):
            raise ValueError(f"Trajectory.image_spans[{i}] = [{sp.start}, {sp.end}) is not inside one prompt "
                             "or observation turn; images enter only through prompts and tool observations")
        prev_end = sp.end
        norm.append(sp)
    unused = set(out) - {sp.sha256 for sp in norm}
    if unused:
        raise ValueError(f"Trajectory.images holds {len(unused)} image(s) no span uses (e.g. "
                         f"{sorted(unused)[0][:16]}...); store only the images the tokens show")
    return out, norm


__all__ = ["ROLES", "ImageSpan", "StepInfo", "Trajectory", "TurnSpan"]
