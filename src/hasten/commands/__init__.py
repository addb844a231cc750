"""The ``hasten`` command line: ``config``, ``launch``, ``test`` and ``env``, one module per subcommand.

Modules here import torch only inside the functions that need it, so ``hasten --help`` stays fast.
"""
