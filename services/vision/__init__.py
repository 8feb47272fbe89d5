"""Vision service: image decoding and the vision encoder, embeddings cached by content hash."""
