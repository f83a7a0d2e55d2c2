"""Write a copy of a GGUF file whose quantized tensors are quantized again to another type.

    python bench/requantize_gguf.py SRC.gguf OUT.gguf --type Q4_0

Every metadata field is copied as it is, and every tensor that is not quantized (F32, F16: the
norms) too; each quantized tensor is dequantized with ``gguf.quants`` (gguf-py's reference
numpy code) and quantized to ``--type``. The tensors are read from the GGUF file itself, in
its own layout, so nothing is permuted (the Hugging Face safetensors that lensdiv caches have
the Q/K rows un-permuted for transformers). Note what this measures: the source is itself a
4-bit file, so the copy is the source's weights with a second rounding on top (Q8_0: a small
one, a control; Q4_0: a coarser 4-bit grid without the offset of Q4_1), not the original
full-precision weights at another level. Model files are never committed: write OUT outside
the repository (``docs/findings_real.py`` writes it to ``$LENSDIV_CACHE/requantized/``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

UNQUANTIZED = ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


def requantize(src: Path, out: Path, qtype_name: str = "Q4_0") -> dict[str, int]:
    """Write ``out``: ``src`` with its quantized tensors quantized to ``qtype_name``; returns
    how many tensors of each source type were re-quantized or copied."""
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[qtype_name]
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(out, arch=arch, endianess=reader.endianess)
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    counts: dict[str, int] = {}
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    datas = []
    for t in reader.tensors:
        name = t.tensor_type.name
        if name in UNQUANTIZED:
            data, raw = np.asarray(t.data), None
            counts[f"{name} copied"] = counts.get(f"{name} copied", 0) + 1
        else:
            weights = quants.dequantize(np.asarray(t.data), t.tensor_type)
            if weights.shape[-1] % block:
                data, raw = np.asarray(t.data), t.tensor_type  # rows not a whole block: keep
                counts[f"{name} kept"] = counts.get(f"{name} kept", 0) + 1
            else:
                data, raw = quants.quantize(weights.astype(np.float32), qtype), qtype
                counts[f"{name} -> {qtype_name}"] = counts.get(f"{name} -> {qtype_name}", 0) + 1
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, raw_dtype=raw)
        datas.append(data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in datas:
        writer.write_tensor_data(data)
    writer.close()
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", default="Q4_0", help="Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, ...")
    args = parser.parse_args(argv)
    counts = requantize(args.src, args.out, args.type)
    print(counts, file=sys.stderr)


if __name__ == "__main__":
    main()
