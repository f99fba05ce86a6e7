"""Regenerate the bundled demo datasets and demo tokenizer (deterministic).

Run from the repository root::

    python -m lightning_megatrain.data.demo.make_demo

Writes, next to this file: ``dataset_info.json``, ``demo_alpaca.json`` (alpaca, 200 rows, some with a system
prompt and a one-turn history), ``demo_sharegpt.json`` (sharegpt, 100 multi-turn conversations with system
prompts, as a column or as a leading ``system`` message), ``demo_messages.jsonl`` (OpenAI messages, 100 rows),
the preference sets ``demo_dpo_alpaca.json`` (alpaca ``ranking``, 120 pairs) and ``demo_dpo_sharegpt.json`` (sharegpt
``ranking``, 60 multi-turn prompts), whose rejected response is the right answer with one detail made wrong, and
``tokenizer/`` (see ``lightning_megatrain.data.tokenizer.build_demo_tokenizer``; trained on the first three only).

The content is simple, checkable tasks (arithmetic, word reversal, unit conversion, capitals, ...) written for
this project.
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

from lightning_megatrain.data.demo import DEMO_DIR
from lightning_megatrain.data.tokenizer import build_demo_tokenizer, demo_corpus

log = logging.getLogger(__name__)

SEED = 1234

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "Canada": "Ottawa", "Australia": "Canberra", "Brazil": "Brasilia", "Egypt": "Cairo",
    "Kenya": "Nairobi", "India": "New Delhi", "Mexico": "Mexico City", "Norway": "Oslo", "Poland": "Warsaw",
    "Greece": "Athens", "Peru": "Lima", "Chile": "Santiago", "Austria": "Vienna", "Ireland": "Dublin",
}
UNITS = [  # (from, to, factor)
    ("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("kilograms", "grams", 1000),
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("liters", "milliliters", 1000), ("days", "hours", 24),
]
WORDS = (
    "the quick brown fox jumps over a lazy dog while small birds sing in green trees near quiet rivers "
    "under bright blue skies and old stone bridges"
).split()
SYSTEMS = [
    "You are a helpful assistant.",
    "You are a precise calculator. Show the equation and the result.",
    "You are a patient tutor. Answer briefly and exactly.",
    "You answer in one short sentence.",
]


def arithmetic(rng: random.Random) -> tuple[str, str, str]:
    a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    if rng.random() < 0.5:
        return f"What is {a} {op} {b}?", "", f"{a} {op} {b} = {result}."
    return "Compute the expression.", f"{a} {op} {b}", f"{a} {op} {b} = {result}."


def reverse_words(rng: random.Random) -> tuple[str, str, str]:
    words = rng.sample(WORDS, rng.randint(3, 6))
    return "Reverse the order of the words in the sentence.", " ".join(words), " ".join(reversed(words))


def convert_units(rng: random.Random) -> tuple[str, str, str]:
    if rng.random() < 0.2:
        celsius = 5 * rng.randint(-8, 20)
        fahrenheit = celsius * 9 // 5 + 32
        return f"Convert {celsius} degrees Celsius to Fahrenheit.", "", f"{celsius} C is {fahrenheit} F."
    source, target, factor = rng.choice(UNITS)
    value = rng.randint(2, 40)
    return f"Convert {value} {source} to {target}.", "", f"{value} {source} is {value * factor} {target}."


def capital(rng: random.Random) -> tuple[str, str, str]:
    country = rng.choice(sorted(CAPITALS))
    return f"What is the capital of {country}?", "", f"The capital of {country} is {CAPITALS[country]}."


def uppercase(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    return "Write the word in capital letters.", word, word.upper()


def count_letters(rng: random.Random) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    return f"How many letters are in the word '{word}'?", "", f"The word '{word}' has {len(word)} letters."


def sort_numbers(rng: random.Random) -> tuple[str, str, str]:
    numbers = rng.sample(range(1, 100), rng.randint(3, 6))
    listed, ordered = ", ".join(map(str, numbers)), ", ".join(map(str, sorted(numbers)))
    return "Sort the numbers from smallest to largest.", listed, ordered


TASKS = (arithmetic, reverse_words, convert_units, capital, uppercase, count_letters, sort_numbers)


def task(rng: random.Random) -> tuple[str, str, str]:
    """One (instruction, input, output) triple from a random task."""
    return rng.choice(TASKS)(rng)


def question(rng: random.Random) -> tuple[str, str]:
    """One (user message, assistant answer) pair, folding the input into the user message."""
    instruction, extra, answer = task(rng)
    return (f"{instruction}\n{extra}" if extra else instruction), answer


def alpaca_rows(rng: random.Random, count: int = 200, preference: bool = False) -> list[dict]:
    """Alpaca rows: an ``output``, or with ``preference`` the right answer ``chosen`` and :func:`wrong_answer`
    ``rejected``; a quarter with a system prompt, a fifth with one earlier turn."""
    rows = []
    for _ in range(count):
        instruction, extra, answer = task(rng)
        responses = {"chosen": answer, "rejected": wrong_answer(answer, rng)} if preference else {"output": answer}
        row = {"instruction": instruction, "input": extra, **responses}
        if rng.random() < 0.25:
            row["system"] = rng.choice(SYSTEMS)
        if rng.random() < 0.2:
            row["history"] = [list(question(rng))]
        rows.append(row)
    return rows


def arithmetic_chain(rng: random.Random, turns: int) -> list[tuple[str, str]]:
    """A multi-turn exchange where each follow-up builds on the previous result."""
    total = rng.randint(2, 50)
    pairs = [(f"Start with the number {total}. What is it doubled?", f"{total} * 2 = {total * 2}.")]
    total *= 2
    for _ in range(turns - 1):
        step = rng.randint(2, 30)
        if rng.random() < 0.5:
            pairs.append((f"Now add {step} to that.", f"{total} + {step} = {total + step}."))
            total += step
        else:
            pairs.append((f"Now subtract {step} from that.", f"{total} - {step} = {total - step}."))
            total -= step
    return pairs


def conversation_pairs(rng: random.Random) -> list[tuple[str, str]]:
    turns = rng.randint(2, 4)
    if rng.random() < 0.3:
        return arithmetic_chain(rng, turns)
    return [question(rng) for _ in range(turns)]


def sharegpt_rows(rng: random.Random, count: int = 100) -> list[dict]:
    rows = []
    for _ in range(count):
        messages = []
        for user, assistant in conversation_pairs(rng):
            messages += [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]
        system = rng.choice(SYSTEMS)
        if rng.random() < 0.3:
            rows.append({"conversations": [{"from": "system", "value": system}, *messages]})
        else:
            rows.append({"conversations": messages, "system": system})
    return rows


def messages_rows(rng: random.Random, count: int = 100) -> list[dict]:
    rows = []
    for _ in range(count):
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.67 else []
        for user, assistant in conversation_pairs(rng)[: rng.randint(1, 3)]:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        rows.append({"messages": messages})
    return rows


def wrong_answer(answer: str, rng: random.Random) -> str:
    """``answer`` with one detail made wrong: its last number moved, a capital swapped, a word's case or order."""
    numbers = list(re.finditer(r"-?\d+", answer))
    if numbers:
        last = numbers[-1]
        value = int(last.group()) + rng.choice([-10, -3, -2, -1, 1, 2, 3, 10])
        return answer[: last.start()] + str(value) + answer[last.end() :]
    if answer.isupper():
        return answer.lower()
    for city in CAPITALS.values():
        if answer.endswith(f" {city}."):
            return answer.replace(city, rng.choice(sorted(set(CAPITALS.values()) - {city})))
    return " ".join(reversed(answer.split()))


def dpo_sharegpt_rows(rng: random.Random, count: int = 60) -> list[dict]:
    rows = []
    for _ in range(count):
        pairs = conversation_pairs(rng)
        messages = []
        for user, assistant in pairs[:-1]:
            messages += [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]
        user, answer = pairs[-1]
        messages.append({"from": "human", "value": user})
        rows.append({"conversations": messages, "system": rng.choice(SYSTEMS),
                     "chosen": {"from": "gpt", "value": answer},
                     "rejected": {"from": "gpt", "value": wrong_answer(answer, rng)}})
    return rows


DATASET_INFO = {
    "demo_alpaca": {
        "file_name": "demo_alpaca.json",
        "columns": {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
                    "history": "history"},
    },
    "demo_sharegpt": {
        "file_name": "demo_sharegpt.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "system": "system"},
    },
    "demo_messages": {
        "file_name": "demo_messages.jsonl",
        "formatting": "sharegpt",
        "columns": {"messages": "messages"},
        "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
                 "system_tag": "system"},
    },
    "demo_dpo_alpaca": {
        "file_name": "demo_dpo_alpaca.json",
        "ranking": True,
        "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected",
                    "system": "system", "history": "history"},
    },
    "demo_dpo_sharegpt": {
        "file_name": "demo_dpo_sharegpt.json",
        "formatting": "sharegpt",
        "ranking": True,
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "system": "system"},
    },
}


def write_demo(out_dir: Path = DEMO_DIR) -> None:
    """Write the demo datasets, ``dataset_info.json`` and the demo tokenizer into ``out_dir``."""
    rng = random.Random(SEED)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "dataset_info.json").write_text(json.dumps(DATASET_INFO, indent=2) + "\n", encoding="utf-8")
    for name, rows in (("demo_alpaca.json", alpaca_rows(rng)), ("demo_sharegpt.json", sharegpt_rows(rng))):
        lines = ",\n".join(json.dumps(row, ensure_ascii=False) for row in rows)
        (out_dir / name).write_text(f"[\n{lines}\n]\n", encoding="utf-8")
    lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in messages_rows(rng))
    (out_dir / "demo_messages.jsonl").write_text(lines, encoding="utf-8")
    preference = (("demo_dpo_alpaca.json", alpaca_rows(rng, 120, preference=True)),
                  ("demo_dpo_sharegpt.json", dpo_sharegpt_rows(rng)))
    for name, rows in preference:
        lines = ",\n".join(json.dumps(row, ensure_ascii=False) for row in rows)
        (out_dir / name).write_text(f"[\n{lines}\n]\n", encoding="utf-8")
    build_demo_tokenizer(out_dir / "tokenizer", corpus=demo_corpus(out_dir))
    log.info("Wrote demo datasets and tokenizer to %s", out_dir)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    write_demo()
