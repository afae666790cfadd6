"""A character-level tokenizer for the default model, built with `tokenizers` (no download).

One token per character plus <pad>/<bos>/<eos>/<unk>; it saves as tokenizer.json +
tokenizer_config.json + special_tokens_map.json, so `AutoTokenizer.from_pretrained(dir)` and
vLLM load it like any fast tokenizer. Encoding prepends <bos>; decoding joins characters.
"""

import json

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
CHARS = "0123456789+-*=() .,?abcdefghijklmnopqrstuvwxyz"


def build_char_tokenizer(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """Vocabulary: the four specials (ids 0-3), then `chars` in order."""
    if len(set(chars)) != len(chars):
        raise ValueError(f"tokenizer characters must be unique, got {chars!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def tokenizer_files(tokenizer: PreTrainedTokenizerFast) -> dict[str, bytes]:
    """The three files an HF directory needs, as bytes.

    `tokenizer_class` is written as PreTrainedTokenizerFast (not transformers 5's
    TokenizersBackend) so older transformers, as pinned by vLLM, load the same directory.
    """
    specials = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": tokenizer.model_max_length,
        "padding_side": "left",
    }
    return {
        "tokenizer.json": tokenizer.backend_tokenizer.to_str().encode(),
        "tokenizer_config.json": _json_bytes(config),
        "special_tokens_map.json": _json_bytes(specials),
    }


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
