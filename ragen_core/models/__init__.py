"""Policies: tiny local Qwen2 models and their tokenizer, loading Hugging Face folders, importing GGUF
files (``ragen model import``), and what a policy reference of ``ragen evaluate`` names.

Import names from the module that defines them; this package re-exports nothing.
"""
