"""Model weights on disk and in memory, for every part that saves or loads them.

``safetensors_io`` (the safetensors format, streamed; tensors that share memory written once), ``files`` (the file
names and metadata keys of saved weights, finding and reading one file, a folder or shards with their index),
``saving`` (``save_model_weights``: sharded, atomic; ``save``), ``tied`` (tied parameters) and ``offloaded`` (the state
dict of a model whose weights a hook keeps elsewhere). Big-model inference, checkpoints and the engines' merges all
use these; none of them imports any of those parts.
"""
