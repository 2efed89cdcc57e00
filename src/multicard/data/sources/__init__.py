"""Where samples come from: image folders (folders.py), packed shards on disk or object storage
(shards.py: a local folder or a URL, base/store.py), dataset functions (user.py), Hugging Face datasets
(hf.py), synthetic data; encoded images not yet decoded; the check that every rank reads the same."""
