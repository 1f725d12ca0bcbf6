"""Paged access to a document folder: the tools of the `long-docs` env, run inside the sandbox.

    python3 docs.py DIR list PAGE PAGE_SIZE
    python3 docs.py DIR read NAME PAGE PAGE_LINES
    python3 docs.py DIR grep PATTERN PAGE PAGE_MATCHES

Output starts with a header line `[... page P/N ...]`. A bad request (no such document, page out of
range, invalid regex) prints `error: ...` and exits 2.
"""

import os
import re
import sys

MAX_PATTERN = 200


def _pages(n_items: int, size: int) -> int:
    return max(1, -(-n_items // size))


def _check_page(page: int, n_pages: int, what: str) -> None:
    if not 1 <= page <= n_pages:
        raise LookupError(f"page {page} is out of range: {what} has pages 1-{n_pages}")


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def cmd_list(root: str, page: int, size: int) -> str:
    names = sorted(os.listdir(root))
    n_pages = _pages(len(names), size)
    _check_page(page, n_pages, "the document list")
    rows = []
    for name in names[(page - 1) * size : page * size]:
        rows.append(f"{name} ({len(_lines(os.path.join(root, name)))} lines)")
    return f"[{len(names)} documents, page {page}/{n_pages}]\n" + "\n".join(rows)


def cmd_read(root: str, name: str, page: int, size: int) -> str:
    names = sorted(os.listdir(root))
    if name not in names:
        raise LookupError(
            f"no document '{name}'; list_docs shows the names (e.g. {names[0] if names else '-'})"
        )
    lines = _lines(os.path.join(root, name))
    n_pages = _pages(len(lines), size)
    _check_page(page, n_pages, name)
    start = (page - 1) * size
    body = "\n".join(f"{start + i + 1}: {line}" for i, line in enumerate(lines[start : start + size]))
    return f"[{name} page {page}/{n_pages}, lines {start + 1}-{min(start + size, len(lines))}]\n{body}"


def cmd_grep(root: str, pattern: str, page: int, size: int) -> str:
    if len(pattern) > MAX_PATTERN:
        raise LookupError(f"pattern longer than {MAX_PATTERN} characters")
    try:
        rx = re.compile(pattern, re.IGNORECASE)
    except re.error as err:
        raise LookupError(f"invalid regular expression ({err})") from None
    hits = []
    for name in sorted(os.listdir(root)):
        for i, line in enumerate(_lines(os.path.join(root, name))):
            if rx.search(line):
                hits.append(f"{name}:{i + 1}: {line}")
    n_pages = _pages(len(hits), size)
    if not hits:
        return f"[0 matches for {pattern!r}]"
    _check_page(page, n_pages, "the matches")
    return f"[{len(hits)} matches for {pattern!r}, page {page}/{n_pages}]\n" + "\n".join(
        hits[(page - 1) * size : page * size]
    )


def run(argv: list[str]) -> tuple[int, str]:
    """(exit code, output) of the command line `argv` = [DIR, COMMAND, ARGS...]."""
    root, cmd, args = argv[0], argv[1], argv[2:]
    try:
        if cmd == "list":
            return 0, cmd_list(root, int(args[0]), int(args[1]))
        if cmd == "read":
            return 0, cmd_read(root, args[0], int(args[1]), int(args[2]))
        if cmd == "grep":
            return 0, cmd_grep(root, args[0], int(args[1]), int(args[2]))
        raise LookupError(f"unknown command {cmd!r}")
    except LookupError as err:
        return 2, f"error: {err.args[0]}"


def main(argv: list[str]) -> int:
    code, out = run(argv)
    print(out)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
