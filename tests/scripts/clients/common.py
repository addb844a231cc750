"""What the client scripts share: tiny models and a tokenizer built in code (nothing downloaded), seeded data.

Nothing here imports hasten or names it: the scripts import ``accelerate`` and the libraries built on it, so the
same text runs on hasten (``--as_accelerate`` or the alias distribution) and on the reference copy of Accelerate.
"""

import random

import torch

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "</s>"]
VOCAB = {token: index for index, token in enumerate(SPECIAL + WORDS)}


def tokenizer(folder=None):
    """A word-level fast tokenizer over ``VOCAB`` (whitespace split), saved to ``folder`` when given."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        eos_token="</s>",
        model_max_length=32,
    )
    if folder is not None:
        fast.save_pretrained(folder)
    return fast


def sentences(count: int, seed: int, length: int = 8) -> list[str]:
    """``count`` sentences of ``length`` words drawn from a private generator seeded with ``seed``."""
    draw = random.Random(seed)
    return [" ".join(draw.choice(WORDS) for _ in range(length)) for _ in range(count)]


def label(sentence: str) -> int:
    """A learnable class: whether the first word is in the first half of ``WORDS``."""
    return int(int(sentence.split()[0][1:]) < len(WORDS) // 2)


def seeded(build):
    """``build()`` after ``torch.manual_seed(0)``: the same initial weights on every process and both sides."""
    torch.manual_seed(0)
    return build()


def tiny_bert_config(**extra):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        pad_token_id=0,
        **extra,
    )


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(VOCAB),
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=5,
        eos_token_id=5,
        pad_token_id=0,
    )
    return seeded(lambda: GPT2LMHeadModel(config))


def state(module) -> dict:
    """``module``'s weights as contiguous CPU copies (tied weights become separate tensors, as safetensors needs)."""
    return {name: tensor.detach().cpu().clone().contiguous() for name, tensor in module.state_dict().items()}


def logged(history: list[dict], key: str) -> list:
    """The ``[step, value]`` pairs of ``key`` in a Trainer's ``log_history``."""
    return [[entry["step"], entry[key]] for entry in history if key in entry]
