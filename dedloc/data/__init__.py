"""Training data: text sources streamed with Hugging Face ``datasets``, a per-peer shuffled order,
on-the-fly tokenization and masking in DataLoader workers, and a resumable position.

Needs the ``train`` extra (``pip install 'dedloc[train]'``).
"""
