"""Reference applications built on gpipe_core: multilingual NMT and AmoebaNet."""
