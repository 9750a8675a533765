"""Glue for the trainers and model libraries people use with vision_ckpt.

Each integration is its own module, imported by name, so that ``import vision_ckpt`` never
imports the library it is for (install it with the matching extra):

- :mod:`vision_ckpt.integrations.lightning`: a PyTorch Lightning callback (``[lightning]``);
- :mod:`vision_ckpt.integrations.hf`: Hugging Face transformers models and ``Trainer`` (``[hf]``).
"""
