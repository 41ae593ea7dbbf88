"""Text in, text out: a checkpoint's tokenizer, DeepSeek-V4's chat format, streaming
detokenisation and stop strings, and ``python -m dsv4_ops generate`` (``generate_cli``).

>>> tok = dsv4_ops.text.load_tokenizer(dsv4_ops.pretrained.tiny())
>>> ids = dsv4_ops.text.encode_chat_ids(tok, [{"role": "user", "content": "Hi"}])
"""
from .chat import encode_chat, encode_chat_ids
from .detokenize import Detokenizer, StopStrings
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["Detokenizer", "StopStrings", "Tokenizer", "encode_chat", "encode_chat_ids", "load_tokenizer"]
