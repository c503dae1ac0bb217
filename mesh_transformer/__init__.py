"""mesh-transformer: train, fine-tune, sample from and serve transformer language models on a mesh."""
from mesh_transformer import host_memory

host_memory.keep_freed_memory()  # before XLA:CPU allocates anything (see host_memory)
