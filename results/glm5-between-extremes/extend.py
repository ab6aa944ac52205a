"""One-off init for run B: tiny-glm5-next-wide (KDA KDA KDA MLA) made GLM-interleaved
(KDA KDA KDA MLA KDA, as GLM-5.3-Flash ends on a KDA layer after its last MLA layer), the new
layer 4 starting as a copy of KDA layer 2. Usage: python extend.py SHAPE_JSON OUT_DIR."""

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from hybridkv.models.loader import write_with_head
from hybridkv.train.shapes import build

WIDE = Path("hybridkv/models/weights/tiny-glm5-next-wide")

config, backbone, lm_head = build("tiny-glm5-next", json.loads(sys.argv[1]))
tensors = load_file(WIDE / "model.safetensors")
state = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
state |= {"layers.4." + k.removeprefix("layers.2."): v.clone() for k, v in state.items() if k.startswith("layers.2.")}
backbone.load_state_dict(state, strict=True)
lm_head.load_state_dict({k.removeprefix("lm_head."): v for k, v in tensors.items() if k.startswith("lm_head.")})
write_with_head(Path(sys.argv[2]), config, backbone, lm_head)
