"""Fitted lenses (docs/science.md D1–D3): fit a tuned, Jacobian or affine lens of a model, and
read every analyzer's residual states through it (``--lens``).

Fitting runs through lensdiv's own machinery: the affine and Jacobian fits are analyzers whose
states stream and merge (one process, ``torchrun`` ranks, ``--shard`` + ``lensdiv merge``), and
the tuned lens trains with ``torch.distributed``'s DDP. The lenses are written in the formats
of the tools that define them (TransformerLens' ``JacobianLens`` file, tuned-lens's
``config.json`` + ``params.pt``) and read back by :mod:`lensdiv.ops.translators`.
"""
