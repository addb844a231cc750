"""sentence-transformers' ``SentenceTransformerTrainer`` and setfit's ``Trainer`` on a tiny BERT body built in code
(saved with the in-code tokenizer to a folder, which ``models.Transformer`` loads: nothing downloaded)."""

from common import label, logged, seeded, sentences, state, tiny_bert_config, tokenizer


def sentence_model(folder):
    """A SentenceTransformer: tiny BERT (dropout on) + mean pooling, same initial weights on every process."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertModel

    from accelerate import PartialState

    body = folder / "body"
    process = PartialState()
    if process.is_main_process:
        seeded(lambda: BertModel(tiny_bert_config())).save_pretrained(body)
        tokenizer(body)
    process.wait_for_everyone()
    transformer = models.Transformer(str(body), max_seq_length=16)
    return SentenceTransformer(modules=[transformer, models.Pooling(32, "mean")], device="cpu")


def part_sentence_transformers(folder):
    """Pairs trained with MultipleNegativesRankingLoss; evaluation every 2 steps on 11 pairs (uneven on one process)."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments, losses

    model = sentence_model(folder)

    def pairs(count, seed):
        anchors = sentences(count, seed)
        return Dataset.from_dict({"anchor": anchors, "positive": [" ".join(a.split()[::-1]) for a in anchors]})

    args = SentenceTransformerTrainingArguments(
        output_dir=str(folder / "run"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=6,
        learning_rate=1e-3,
        eval_strategy="steps",
        eval_steps=2,
        seed=0,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=pairs(32, 8),
        eval_dataset=pairs(11, 9),
        loss=losses.MultipleNegativesRankingLoss(model),
    )
    trainer.train()
    history = trainer.state.log_history
    return {"loss": logged(history, "loss"), "eval_loss": logged(history, "eval_loss")}, state(model)


def part_setfit(folder):
    """setfit: contrastive pairs fine-tune the body (through sentence-transformers' trainer), then a logistic head."""
    import torch
    from datasets import Dataset
    from setfit import SetFitModel, Trainer, TrainingArguments
    from sklearn.linear_model import LogisticRegression

    model = SetFitModel(model_body=sentence_model(folder), model_head=LogisticRegression())
    texts = sentences(16, 10)
    train = Dataset.from_dict({"text": texts, "label": [label(t) for t in texts]})
    args = TrainingArguments(
        output_dir=str(folder / "run"),
        batch_size=4,
        num_epochs=1,
        max_steps=6,
        seed=0,
        report_to="none",
        show_progress_bar=False,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train)
    trainer.train()
    probe = sentences(9, 11)
    numbers = {
        "loss": logged(trainer.st_trainer.state.log_history, "embedding_loss"),
        "predictions": [int(p) for p in model.predict(probe)],
        "probabilities": model.predict_proba(probe).tolist(),
    }
    weights = state(model.model_body)
    weights["head.coef"] = torch.tensor(model.model_head.coef_)
    weights["head.intercept"] = torch.tensor(model.model_head.intercept_)
    return numbers, weights


PARTS = {"sentence_transformers": part_sentence_transformers, "setfit": part_setfit}
