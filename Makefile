# The two set-up commands of the README:
#   make demo   builds lightfoot and copies a generated ~1 GiB sample, showing the page cache
#   make test   installs what the tests need (Debian packages), then runs every test
CARGO ?= cargo

.PHONY: build demo test deps lint bench clean

build:
	$(CARGO) build --release

demo: build
	./scripts/demo.sh

deps:
	./scripts/install-deps.sh

# Release mode: the integration tests copy tens of MiB, and the cache behaviour under test
# is the one users get.
test: deps
	$(CARGO) build --release --all-targets
	$(CARGO) test --release -- --test-threads=2

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

bench: build
	./bench/copy.sh

clean:
	$(CARGO) clean
