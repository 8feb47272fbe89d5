"""Vision service: image decoding and encoding, embeddings cached by content hash. Not built yet (issue #11)."""
