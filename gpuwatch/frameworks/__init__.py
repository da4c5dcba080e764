"""gpuwatch for the trainers people run: one line each (docs/frameworks.md).

`gpuwatch.frameworks.hf` (Hugging Face Trainer), `gpuwatch.frameworks.lightning` (PyTorch Lightning)
and `gpuwatch.frameworks.torchtitan`: each turns its framework's own hooks into the calls of
`gpuwatch.trainer.hooks.TrainingHooks`, and seals and verifies the checkpoints the framework writes
(`gpuwatch.trainer.sealed`). Job side: nothing here imports a daemon part; each module imports its
framework, so import only the one you use.
"""
