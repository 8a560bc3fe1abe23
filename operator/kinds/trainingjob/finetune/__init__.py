"""spec.finetune: a LoRA adapter trained on a frozen base model: api.py (its fields), config.py (the trainer's
FinetuneSpec, where the adapter is exported), base_model.py (a base model from another TrainingJob, resolved against
it; pure), io.py (the read of that job)."""
