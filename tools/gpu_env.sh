# Source on the GPU machine: installs the carried wheels (pydantic, openai) the image lacks. See ../shared/wheels.
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl && export PYTHONPATH=$PWD/.site
export PYTHONUNBUFFERED=1
