"""The Open Inference Protocol (KServe v2) data types, independent of any transport."""
