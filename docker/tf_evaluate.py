"""The mixed-framework check of the images (docker/image_check.py): a torch run's model, converted with
`polytrain checkpoint convert --to keras`, loaded into the TensorFlow model that the run's own spec builds with
`framework: tensorflow`, and evaluated on the same held-out samples. Prints both accuracies as JSON.

    python docker/tf_evaluate.py RUN_DIR WEIGHTS.weights.h5
"""

import json
import sys
from pathlib import Path

from polytrain import validation
from polytrain.adapters.tensorflow.framework import TensorFlowFramework
from polytrain.adapters.tensorflow.local import LocalBackend
from polytrain.data import load_dataset
from polytrain.world import World

run, weights = Path(sys.argv[1]), sys.argv[2]
manifest = json.loads((run / "model.json").read_text())
spec = validation.from_dict({**manifest["spec"], "framework": "tensorflow", "output": str(run) + "-tf"})
data = load_dataset(spec.data, spec.seed)
fw = TensorFlowFramework(spec, World(), LocalBackend(spec, World()))
fw.build(data.info)
fw.model.load_weights(weights)
correct, count = fw.evaluate(data.x_val, data.y_val)["accuracy"]
print(json.dumps({"torch_accuracy": manifest["val_accuracy"], "tensorflow_accuracy": correct / count}))
