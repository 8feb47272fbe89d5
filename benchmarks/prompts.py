"""Chat prompts shared by the benchmark scripts (run as scripts, so imported from this folder)."""

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a ten-year-old.",
    "Give three tips for writing clean Python code.",
    "What are the main differences between TCP and UDP?",
    "Describe the water cycle in a few sentences.",
    "Why is the sky blue?",
    "Suggest a name for a friendly robot and explain why.",
]
