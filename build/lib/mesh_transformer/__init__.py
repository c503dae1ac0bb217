"""mesh-transformer: train, fine-tune, sample from and serve transformer language models on a mesh."""
