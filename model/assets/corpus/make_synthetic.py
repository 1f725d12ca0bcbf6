# ruff: noqa: E501  (data tables)
"""Writes the synthetic part of the tokenizer corpus: arithmetic.txt, tool_calls.txt and chat.txt.

prose.txt, code.txt and unicode.txt are hand-written. The generated files are committed; rerunning this
script (`python model/assets/corpus/make_synthetic.py`) reproduces them byte for byte (fixed seed), after
which `python -m model.tokenizer build` retrains the tokenizer.
"""

import json
import random
from pathlib import Path

out = Path(__file__).resolve().parent
rng = random.Random(20240601)

# ---------------- arithmetic ----------------
lines = []
ops = ["+", "-", "*", "/"]
words = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}


def num(mag):
    return rng.randint(0, 10**mag)


for _ in range(900):
    kind = rng.random()
    if kind < 0.35:
        a, b = num(rng.randint(1, 4)), num(rng.randint(1, 3))
        op = rng.choice(ops[:3])
        val = eval(f"{a}{op}{b}")
        lines.append(f"{a} {op} {b} = {val}")
    elif kind < 0.5:
        a, b = num(3), rng.randint(1, 99)
        q, r = divmod(a, b)
        lines.append(f"{a} / {b} = {q} remainder {r}" if r else f"{a} / {b} = {q}")
    elif kind < 0.7:
        a, b, c = num(2), num(2), num(2)
        o1, o2 = rng.choice(ops[:3]), rng.choice(ops[:3])
        expr = f"({a} {o1} {b}) {o2} {c}" if rng.random() < 0.5 else f"{a} {o1} {b} {o2} {c}"
        lines.append(f"Q: What is {expr}?\nA: {expr} = {eval(expr)}. The answer is {eval(expr)}.")
    elif kind < 0.85:
        a, b = num(2), num(2)
        op = rng.choice(ops[:3])
        lines.append(f"What is {a} {words[op]} {b}? {a} {words[op]} {b} is {eval(f'{a}{op}{b}')}.")
    elif kind < 0.93:
        x = round(rng.uniform(-100, 100), rng.randint(1, 3))
        y = round(rng.uniform(0.5, 50), 2)
        lines.append(f"{x} * {y} = {round(x * y, 4)}; {x} + {y} = {round(x + y, 4)}")
    else:
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        c = rng.randint(1, 50)
        lines.append(f"Solve {a}x + {c} = {a * b + c}. Subtract {c}: {a}x = {a * b}. Divide by {a}: x = {b}.")
(out / "arithmetic.txt").write_text("\n".join(lines) + "\n")

# ---------------- tool calls ----------------
cities = [
    "Paris",
    "Tokyo",
    "Lagos",
    "Lima",
    "Oslo",
    "Cairo",
    "Sydney",
    "Toronto",
    "Mumbai",
    "Berlin",
    "São Paulo",
    "Zürich",
]
files = [
    "src/main.py",
    "README.md",
    "data/input.csv",
    "tests/test_app.py",
    "config.yaml",
    "notes.txt",
    "/tmp/out.json",
    "setup.cfg",
]
queries = [
    "python list comprehension",
    "weather tomorrow",
    "capital of Australia",
    "how to reverse a string",
    "boiling point of water",
    "binary search complexity",
    "git undo last commit",
    "json schema example",
]
cmds = [
    "ls -la",
    "cat README.md",
    "python -m pytest -q",
    "pip list | grep torch",
    "wc -l data/input.csv",
    "grep -rn TODO src/",
    "echo $HOME",
    "python3 -c 'print(sum(range(10)))'",
    "head -n 5 notes.txt",
    "mkdir -p out && ls out",
]
snippets = [
    "print(2 ** 10)",
    "import math\nprint(math.sqrt(2))",
    "xs = [3, 1, 2]\nprint(sorted(xs))",
    "def f(n):\n    return n * (n + 1) // 2\nprint(f(100))",
    "print(sum(i * i for i in range(1, 11)))",
    "s = 'hello world'\nprint(s[::-1])",
    "import json\nprint(json.dumps({'a': 1, 'b': [1, 2]}))",
    "for i in range(3):\n    print(i, i ** 2)",
]

schemas = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12 * (3 + 4)"}},
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code in a sandbox and return stdout.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer", "default": 10}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a text file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit the final answer.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string"}},
                "required": ["answer"],
            },
        },
    },
]
blocks = []
for s in schemas:
    blocks.append(json.dumps(s))
    blocks.append(json.dumps(s["function"], indent=2))


def call():
    r = rng.random()
    if r < 0.25:
        a, b, c = rng.randint(0, 999), rng.randint(1, 99), rng.randint(0, 50)
        expr = rng.choice(
            [f"{a} + {b}", f"{a} * {b}", f"({a} - {b}) * {c}", f"{a} / {b}", f"{a} * {b} + {c}"]
        )
        val = eval(expr)
        res = str(int(val)) if float(val).is_integer() else f"{val:.6g}"
        return {"name": "calculator", "arguments": {"expression": expr}}, res
    if r < 0.4:
        code = rng.choice(snippets)
        return {"name": "python", "arguments": {"code": code}}, json.dumps(
            {"stdout": "ok\n", "stderr": "", "exit_code": 0}
        )
    if r < 0.55:
        cmd = rng.choice(cmds)
        return {"name": "bash", "arguments": {"command": cmd}}, json.dumps(
            {"exit_code": rng.choice([0, 0, 0, 1, 2]), "stdout": "", "stderr": ""}
        )
    if r < 0.65:
        return {
            "name": "read_file",
            "arguments": {"path": rng.choice(files)},
        }, "error: file not found" if rng.random() < 0.3 else "line 1\nline 2"
    if r < 0.72:
        return {
            "name": "write_file",
            "arguments": {"path": rng.choice(files), "content": "x = 1\n"},
        }, json.dumps({"ok": True, "bytes_written": 6})
    if r < 0.82:
        return {
            "name": "search",
            "arguments": {"query": rng.choice(queries), "max_results": rng.randint(1, 10)},
        }, json.dumps({"results": [{"title": "Result", "url": "https://example.com/page"}]})
    if r < 0.92:
        city = rng.choice(cities)
        return (
            {
                "name": "get_weather",
                "arguments": {"city": city, "unit": rng.choice(["celsius", "fahrenheit"])},
            },
            json.dumps(
                {
                    "city": city,
                    "temperature": rng.randint(-10, 35),
                    "condition": rng.choice(["sunny", "cloudy", "rain", "snow"]),
                },
                ensure_ascii=False,
            ),
        )
    return {"name": "submit", "arguments": {"answer": str(rng.randint(0, 10000))}}, json.dumps(
        {"accepted": True}
    )


for _ in range(420):
    c, res = call()
    style = rng.random()
    if style < 0.6:
        blocks.append(json.dumps(c, ensure_ascii=False))
    else:
        blocks.append(json.dumps(c, ensure_ascii=False, indent=rng.choice([None, 2])))
    blocks.append(res)
    if rng.random() < 0.15:
        blocks.append(json.dumps({"role": "tool", "name": c["name"], "content": res}, ensure_ascii=False))
(out / "tool_calls.txt").write_text("\n".join(blocks) + "\n")

# ---------------- chat transcripts (role headers as the template renders them, specials removed) ----------------
openers = [
    "Sure.",
    "Let me check.",
    "I'll compute that with the calculator.",
    "Let me run the code.",
    "Good question.",
    "I need to look at the file first.",
    "Let me search for that.",
]
closers = ["The answer is {v}.", "So the result is {v}.", "Done: {v}.", "That gives {v}."]
systems = [
    "You are a helpful assistant.",
    "You are a careful assistant that uses tools when needed.",
    "Solve the task. Use the tools to check your work, then give the final answer.",
]
chats = []
for _ in range(60):
    c, res = call()
    v = res if len(res) < 12 else "done"
    chats.append("system\n" + rng.choice(systems))
    chats.append(
        "user\n"
        + rng.choice(["Please help: ", "Task: ", "", "Question: "])
        + json.dumps(c["arguments"], ensure_ascii=False)
    )
    chats.append("assistant\n" + rng.choice(openers) + json.dumps(c, ensure_ascii=False))
    chats.append("tool\n" + res)
    chats.append("assistant\n" + rng.choice(closers).format(v=v))
(out / "chat.txt").write_text("\n".join(chats) + "\n")
