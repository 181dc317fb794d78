# The two set-up commands of the README:
#   make demo   builds lightfoot and copies a generated ~1 GiB sample, showing the page cache
#   make test   installs what the tests need (Debian packages), then runs every test
CARGO ?= cargo

.PHONY: build demo test deps lint bench fuzz clean

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

# Fuzzing, by hand (`make test` only replays the kept inputs, in tests/fuzz_replay.rs): each
# target for FUZZ_TIME seconds with one worker, on nightly (`cargo install cargo-fuzz`). New
# corpus entries land in fuzz/corpus/<target>, crashes in fuzz/artifacts/<target>
# (docs/fuzzing.md says what to do with them).
FUZZ_TIME ?= 300
FUZZ_TARGETS ?= handshake request connection

# `connection` runs without a sanitizer: it is safe Rust, and ASan made it 3 times slower.
fuzz:
	cd fuzz && for t in $(FUZZ_TARGETS); do \
		case $$t in \
			connection) opts="-s none"; flags="-max_len=2048 -len_control=0" ;; \
			*) opts=""; flags="-max_len=16384" ;; \
		esac; \
		$(CARGO) +nightly fuzz run $$opts -a -O $$t -- -max_total_time=$(FUZZ_TIME) -timeout=30 \
			$$flags -rss_limit_mb=4096 -print_final_stats=1 || exit 1; \
	done

bench: build
	./bench/copy.sh

clean:
	$(CARGO) clean
