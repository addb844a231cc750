"""transformers' ``Trainer`` and ``Seq2SeqTrainer`` and trl's ``SFTTrainer`` on tiny models, dropout on, shuffled data.

Each part returns ``(numbers, weights)``: the losses and evaluation metrics logged, and the final state dict.
"""

import numpy as np
import torch
from common import VOCAB, label, logged, seeded, sentences, state, tiny_bert_config, tiny_gpt2, tokenizer
from torch.utils.data import Dataset

COMMON_ARGS = {
    "seed": 0,
    "use_cpu": True,
    "report_to": "none",
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
    "save_strategy": "no",
    "logging_steps": 1,
}


class Classified(Dataset):
    """Pre-tokenized sentences (no tokenizer at run time) with ``label`` as the class."""

    def __init__(self, count: int, seed: int):
        self.items = []
        for text in sentences(count, seed):
            ids = [VOCAB["[CLS]"]] + [VOCAB[w] for w in text.split()] + [VOCAB["[SEP]"]]
            self.items.append(
                {
                    "input_ids": torch.tensor(ids),
                    "attention_mask": torch.ones(len(ids), dtype=torch.long),
                    "labels": torch.tensor(label(text)),
                }
            )

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def accuracy(prediction) -> dict:
    return {
        "accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean()),
        "rows": len(prediction.label_ids),
    }


def part_trainer(folder):
    """BERT classification: gradient checkpointing, accumulation, evaluation every 3 steps on 13 rows (uneven)."""
    from transformers import BertForSequenceClassification, Trainer, TrainingArguments

    model = seeded(lambda: BertForSequenceClassification(tiny_bert_config(num_labels=2)))
    args = TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=1e-3,
        gradient_checkpointing=True,
        eval_strategy="steps",
        eval_steps=3,
        **COMMON_ARGS,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Classified(48, 1),
        eval_dataset=Classified(13, 2),
        compute_metrics=accuracy,
    )
    trainer.train()
    predicted = trainer.predict(Classified(13, 2))
    numbers = {
        "loss": logged(trainer.state.log_history, "loss"),
        "eval_loss": logged(trainer.state.log_history, "eval_loss"),
        "eval_accuracy": logged(trainer.state.log_history, "eval_accuracy"),
        "eval_rows": logged(trainer.state.log_history, "eval_rows"),
        "predictions": predicted.predictions.tolist(),
    }
    return numbers, state(trainer.model)


class Reversal(Dataset):
    """Sequence to sequence: 8 word ids in, the first 5 reversed and ``</s>`` out."""

    def __init__(self, count: int, seed: int):
        self.items = []
        for text in sentences(count, seed):
            ids = [VOCAB[w] for w in text.split()]
            self.items.append(
                {
                    "input_ids": torch.tensor(ids + [VOCAB["</s>"]]),
                    "labels": torch.tensor(ids[:5][::-1] + [VOCAB["</s>"]]),
                }
            )

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def token_accuracy(prediction) -> dict:
    predictions, labels = prediction.predictions, prediction.label_ids
    width = min(predictions.shape[1], labels.shape[1])
    return {"token_accuracy": float((predictions[:, -width:] == labels[:, -width:]).mean()), "rows": len(labels)}


def part_seq2seq(folder):
    """Tiny T5 with ``Seq2SeqTrainer``: generation in evaluation (``predict_with_generate``) on 7 rows."""
    from transformers import (
        DataCollatorForSeq2Seq,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        T5Config,
        T5ForConditionalGeneration,
    )

    config = T5Config(
        vocab_size=len(VOCAB),
        d_model=32,
        d_ff=64,
        d_kv=16,
        num_layers=2,
        num_heads=2,
        pad_token_id=0,
        eos_token_id=VOCAB["</s>"],
        decoder_start_token_id=0,
    )
    model = seeded(lambda: T5ForConditionalGeneration(config))
    args = Seq2SeqTrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=6,
        learning_rate=3e-3,
        eval_strategy="steps",
        eval_steps=3,
        predict_with_generate=True,
        generation_max_length=8,
        **COMMON_ARGS,
    )
    collator = DataCollatorForSeq2Seq(tokenizer(), model=model)
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=Reversal(40, 3),
        eval_dataset=Reversal(7, 4),
        data_collator=collator,
        compute_metrics=token_accuracy,
    )
    trainer.train()
    numbers = {
        "loss": logged(trainer.state.log_history, "loss"),
        "eval_loss": logged(trainer.state.log_history, "eval_loss"),
        "eval_token_accuracy": logged(trainer.state.log_history, "eval_token_accuracy"),
        "eval_rows": logged(trainer.state.log_history, "eval_rows"),
    }
    return numbers, state(trainer.model)


def part_trl(folder):
    """trl's ``SFTTrainer`` on a text dataset, tokenized by trl with the in-code tokenizer, tiny GPT-2."""
    from datasets import Dataset as HFDataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(folder),
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=6,
        learning_rate=1e-3,
        max_length=16,
        bf16=False,
        eval_strategy="steps",
        eval_steps=3,
        **COMMON_ARGS,
    )
    train = HFDataset.from_dict({"text": sentences(24, 5)})
    evaluation = HFDataset.from_dict({"text": sentences(5, 6)})
    trainer = SFTTrainer(
        model=tiny_gpt2(), args=args, train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer()
    )
    trainer.train()
    history = trainer.state.log_history
    numbers = {
        key: logged(history, key)
        for key in ("loss", "mean_token_accuracy", "eval_loss", "eval_mean_token_accuracy", "eval_num_tokens")
    }
    return numbers, state(trainer.model)


PARTS = {"trainer": part_trainer, "seq2seq": part_seq2seq, "trl": part_trl}
