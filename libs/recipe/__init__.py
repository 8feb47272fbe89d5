"""The tokenizer "recipe": chat prompts whose control tokens come only from the template.

``ChatRecipe`` (``chat.py``) renders a model's own chat template and encodes
it so that text a client wrote (messages, tool calls, tool results, tool
schemas) can never become a control token, while a benign conversation gets
exactly Hugging Face's ids. ``vocab.py`` sorts added tokens into control and
text tokens, ``placeholders.py`` hides control strings in client text during
rendering, ``messages.py`` turns OpenAI-shaped messages into template input.
See ``chat.py``'s docstring for the pipeline and docs/architecture.md, "Tokenizer: the recipe".
"""

from deepinfer.recipe.chat import ChatRecipe, Segment
from deepinfer.recipe.messages import ROLES, content_text, template_messages, template_tools
from deepinfer.recipe.vocab import Vocab, load_vocab

__all__ = ["ChatRecipe", "Segment", "ROLES", "Vocab", "content_text", "load_vocab", "template_messages",
           "template_tools"]
