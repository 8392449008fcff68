"""ToyTrainer (trainer.py), a small third-party-style GRPO trainer, and its rlaudit adapter
(adapter.py): the worked example of docs/targets.md."""
