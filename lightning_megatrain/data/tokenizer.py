"""Build the byte-level BPE demo tokenizer shipped in ``lightning_megatrain/data/demo/tokenizer``.

The shipped files are the output of :func:`build_demo_tokenizer` (regenerate everything with
``python -m lightning_megatrain.data.demo.make_demo``). The tokenizer is trained locally with the
``tokenizers`` library on the demo datasets, so nothing is fetched from a hub.

Chat format rendered by :data:`CHAT_TEMPLATE` (one turn per message, nothing between turns)::

    <|bos|><|system|>\\n{system}<|end|><|user|>\\n{question}<|end|><|assistant|>\\n{answer}<|end|>

``add_generation_prompt=True`` appends ``<|assistant|>\\n``, so an assistant turn's trained tokens are exactly
``{answer}<|end|>``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lightning_megatrain.data.demo import DEMO_DATA_FILES, DEMO_DIR
from lightning_megatrain.data.readers import read_rows

log = logging.getLogger(__name__)

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
TURN_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *TURN_TOKENS)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _strings(value: Any) -> Iterator[str]:
    """Every string nested anywhere inside ``value`` (dict keys excluded)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def demo_corpus(demo_dir: Path = DEMO_DIR) -> Iterator[str]:
    """Yield every text field of the demo datasets, in file and row order (deterministic).

    Args:
        demo_dir: Folder holding the files named in :data:`DEMO_DATA_FILES`; default the bundled demo folder.
    """
    for name in DEMO_DATA_FILES:
        for row in read_rows(Path(demo_dir) / name):
            yield from _strings(row)


def build_demo_tokenizer(
    out_dir: str | Path, corpus: Iterable[str] | None = None, vocab_size: int = 1024
) -> PreTrainedTokenizerFast:
    """Train the demo byte-level BPE tokenizer and save it as a transformers tokenizer folder.

    Writes ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template inlined) into ``out_dir``,
    loadable offline with ``AutoTokenizer.from_pretrained(out_dir)``.

    Args:
        out_dir: Destination folder (created if missing).
        corpus: Training texts; default :func:`demo_corpus` (the bundled demo datasets).
        vocab_size: Target vocabulary size including the 256 byte symbols and the special tokens; default 1024.
            The trainer stops earlier when the corpus has no more merges to learn.

    Returns:
        The saved tokenizer.
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(demo_corpus() if corpus is None else corpus, trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(TURN_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    log.info("Saved demo tokenizer (vocab %d) to %s", len(tokenizer), out_dir)
    return tokenizer
