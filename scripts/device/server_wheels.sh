# Sourced by the device scripts that serve: install the server's carried wheels (.whl/; which ones:
# serving_8b.sh) once into $SERVER_SITE, left empty when none were carried. Callers add it to PYTHONPATH.
SERVER_SITE=""
if [ -d .whl ]; then
  SERVER_SITE=/tmp/site
  [ -d "$SERVER_SITE" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target "$SERVER_SITE" .whl/*.whl
fi
