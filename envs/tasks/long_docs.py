"""Long-document tasks: a folder of synthetic documents, a question only reading can answer.

Each document is lines of filler prose. Scattered through the set are facts about vaults:

    The jade compass is stored in vault V-371.        (location fact)
    Vault V-371 opens with access code 4821.           (code fact)

The question names one artifact and asks for its vault's access code, so the agent must find the
location fact, then the code fact (usually in another document). Codes are random, so guessing
does not work. Filler words contain no digits and no fact vocabulary, so a grep for a vault id
finds only its facts. Size scales with `num_docs * lines_per_doc * words_per_line`; with the
default 12 words a line (~70 characters, ~21 tokens of Odyssey's tokenizer), difficulty 2 holds
4.6M characters, ~1.4M tokens of text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.tasks.difficulty import resolve_preset
from envs.tool_call import format_tool_call

FILLER = tuple(
    """about above across after again against almost along already also although always among
    another around away back because become before began behind being below between beyond both
    bright brought build built came carry cause certain change clear close cold color common could
    country course cover cross dark deep different distant during early earth east easy eight
    either else enough even evening ever every example face fall family far farm fast feel field
    final fire first fish five follow food foot forest form found four free friend front full garden
    gather gave girl give glass gold good great green ground group grow half hand happen hard head
    hear heard heavy held help high hill hold home horse hour house however idea inside island keep
    kind king land large last late later learn leave left letter light line little live long look
    made main make many mark matter mean measure might mile mind minute money moon more morning
    most mother mountain move much music name near need never next night north nothing notice number
    ocean often old once only open order other paper part pass past people perhaps person picture
    piece place plain plan plant point port power present pull quiet quick rain ran reach read ready
    real record remember rest river road rock room round rule said same scene school science sea
    second seem self sentence serve set shape ship short should show side simple since sing size sky
    slow small snow soft soil song soon sound south space special spring stand star start state
    stay step still stone stood story strong study such summer sun sure surface table tail take
    talk teach tell ten than that their then there these thing think those though thought three
    through time together told took toward town track travel tree true turn under until upon usual
    valley very voice walk wall warm watch water wave weather week weight went west where while
    white whole wide wild will wind window winter with within without wood word work world write
    year young""".split()
)
ADJECTIVES = tuple(
    "amber brass bronze cobalt copper crimson ebony golden granite ivory jade marble obsidian onyx "
    "pearl scarlet silver slate topaz velvet violet walnut".split()
)
NOUNS = tuple(
    "astrolabe chalice compass crown dagger hourglass lantern locket medallion mirror orb quill "
    "scepter sextant statue telescope tiara urn vase".split()
)


@dataclass(frozen=True)
class LongDocsConfig:
    """Document-set size and tool page sizes (all observation sizes scale from these)."""

    num_docs: int = 4
    lines_per_doc: int = 40
    words_per_line: int = 12
    num_vaults: int = 4  # vaults with facts; all but one are distractors
    page_lines: int = 20  # lines per read_doc page
    grep_page_matches: int = 20  # matches per grep page
    list_page_docs: int = 100  # names per list_docs page

    def __post_init__(self) -> None:
        for name in ("num_docs", "lines_per_doc", "words_per_line", "num_vaults", "page_lines",
                     "grep_page_matches", "list_page_docs"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"long-docs config {name} must be >= 1, got {getattr(self, name)}")
        if 2 * self.num_vaults > self.num_docs * self.lines_per_doc:
            raise ValueError(
                "long-docs config: 2 * num_vaults facts do not fit in num_docs * lines_per_doc lines"
            )
        if self.num_vaults > len(ADJECTIVES) * len(NOUNS):
            raise ValueError(f"num_vaults must be <= {len(ADJECTIVES) * len(NOUNS)}")

    @property
    def approx_chars(self) -> int:
        """Rough size of the document set in characters (~5.7 characters per word with its space)."""
        return int(self.num_docs * self.lines_per_doc * (self.words_per_line * 5.7 + 1))


DIFFICULTIES: dict[int, LongDocsConfig] = {
    0: LongDocsConfig(num_docs=4, lines_per_doc=40, num_vaults=4, page_lines=20),
    1: LongDocsConfig(num_docs=16, lines_per_doc=200, num_vaults=12, page_lines=50),
    2: LongDocsConfig(num_docs=64, lines_per_doc=1000, num_vaults=32, page_lines=100, grep_page_matches=50),
    3: LongDocsConfig(num_docs=256, lines_per_doc=1000, num_vaults=64, page_lines=200, grep_page_matches=100),
}


def resolve_config(difficulty: int, overrides: dict[str, Any] | None = None) -> LongDocsConfig:
    """The preset for `difficulty` with `overrides` (LongDocsConfig field -> value) applied."""
    return resolve_preset("long-docs", DIFFICULTIES, difficulty, overrides)


@dataclass(frozen=True)
class Fact:
    text: str
    doc: str
    line: int  # 1-based


@dataclass(frozen=True)
class LongDocsTask:
    task_id: str
    prompt: str
    config: LongDocsConfig
    docs: dict[str, str]  # name -> text
    artifact: str
    vault: str
    code: int
    location_fact: Fact
    code_fact: Fact

    def page_of(self, fact: Fact) -> int:
        return (fact.line - 1) // self.config.page_lines + 1


def _filler_lines(rng: np.random.Generator, n: int, words: int) -> list[str]:
    ids = rng.integers(0, len(FILLER), size=(n, words))
    lines = [" ".join(FILLER[i] for i in row) for row in ids]
    return [line[:1].upper() + line[1:] + "." for line in lines]


def generate(seed: int, config: LongDocsConfig) -> LongDocsTask:
    rng = np.random.default_rng(seed)
    n_lines = config.num_docs * config.lines_per_doc
    names = [f"doc_{i:03d}.txt" for i in range(config.num_docs)]
    lines = _filler_lines(rng, n_lines, config.words_per_line)

    pairs = rng.choice(len(ADJECTIVES) * len(NOUNS), size=config.num_vaults, replace=False)
    artifacts = [f"{ADJECTIVES[p // len(NOUNS)]} {NOUNS[p % len(NOUNS)]}" for p in pairs]
    vaults = [f"V-{v}" for v in rng.choice(np.arange(100, 1000), size=config.num_vaults, replace=False)]
    codes = [int(c) for c in rng.choice(np.arange(1000, 10000), size=config.num_vaults, replace=False)]
    slots = rng.choice(n_lines, size=2 * config.num_vaults, replace=False)
    facts: list[tuple[Fact, Fact]] = []
    for k in range(config.num_vaults):
        loc_text = f"The {artifacts[k]} is stored in vault {vaults[k]}."
        code_text = f"Vault {vaults[k]} opens with access code {codes[k]}."
        located = []
        for text, slot in ((loc_text, int(slots[2 * k])), (code_text, int(slots[2 * k + 1]))):
            lines[slot] = text
            located.append(Fact(text, names[slot // config.lines_per_doc], slot % config.lines_per_doc + 1))
        facts.append((located[0], located[1]))
    docs = {
        name: "\n".join(lines[i * config.lines_per_doc : (i + 1) * config.lines_per_doc]) + "\n"
        for i, name in enumerate(names)
    }
    target = int(rng.integers(config.num_vaults))
    return LongDocsTask(
        task_id=f"long-docs/{seed}/{config.num_docs}x{config.lines_per_doc}",
        prompt=(
            f"What is the access code of the vault that stores the {artifacts[target]}? "
            "The answer is in the documents; answer with the 4-digit code."
        ),
        config=config,
        docs=docs,
        artifact=artifacts[target],
        vault=vaults[target],
        code=codes[target],
        location_fact=facts[target][0],
        code_fact=facts[target][1],
    )


def oracle_actions(task: LongDocsTask) -> list[str]:
    """The scripted perfect policy, using only what its observations show: grep the artifact (its output
    is the location fact, naming the vault), grep that vault (its output adds the code fact), answer.
    Each action copies from the text before it (question -> artifact, location fact -> vault, code fact
    -> code), so a policy imitating it learns a skill it can apply, not a file position it cannot know."""
    return [
        format_tool_call("grep", {"pattern": task.artifact}),
        format_tool_call("grep", {"pattern": task.vault}),
        format_tool_call("answer", {"code": task.code}),
    ]


def reader_actions(task: LongDocsTask, calls_per_turn: int = 1) -> list[str]:
    """A policy that reads every page of every document (the longest trajectory), then answers.

    This is how trajectories reach 1e5-1e6 tokens at difficulty >= 2.
    """
    calls = []
    for name, text in task.docs.items():
        n_pages = -(-text.count("\n") // task.config.page_lines)
        calls += [format_tool_call("read_doc", {"name": name, "page": p}) for p in range(1, n_pages + 1)]
    turns = ["\n".join(calls[i : i + calls_per_turn]) for i in range(0, len(calls), calls_per_turn)]
    return [*turns, format_tool_call("answer", {"code": task.code})]
