# The two set-up commands of the README:
#   make demo   builds lightfoot and copies a generated ~1 GiB sample, showing the page cache
#   make test   installs what the tests need (Debian packages), then runs every test
CARGO ?= cargo

.PHONY: build demo test deps lint bench fuzz clean install uninstall

build:
	$(CARGO) build --release

demo: build
	./scripts/demo.sh

# `make install` (after `make`): the binary, its man pages and its bash, zsh and fish
# completions under $(DESTDIR)$(PREFIX), the completions where Debian's shells look for them,
# and `lightfoot run`'s preload library in $(libdir) (never setuid, never /etc/ld.so.preload),
# where the installed binary looks for it: ../lib/lightfoot/ from its own directory.
# It never builds: run as root, cargo would leave root-owned files in target/ and ~/.cargo.
# The pages and completions come from the installed binary itself (`lightfoot __generate`,
# src/cli/generate.rs), so they describe exactly its flags and are never checked in to drift.
PREFIX ?= /usr/local
BIN ?= $(or $(CARGO_TARGET_DIR),target)/release/lightfoot
PRELOAD ?= $(dir $(BIN))liblightfoot_preload.so
# Each directory can be set on the command line too (docs/install.md: zsh and fish).
bindir = $(PREFIX)/bin
libdir = $(PREFIX)/lib/lightfoot
man1dir = $(PREFIX)/share/man/man1
bashcompdir = $(PREFIX)/share/bash-completion/completions
zshcompdir = $(PREFIX)/share/zsh/vendor-completions
fishcompdir = $(PREFIX)/share/fish/vendor_completions.d

# The sources are those cargo built the binary from (its dep-info, BIN.d): src/ also holds
# unit-test files that never reach the binary, and touching one does not make cargo rebuild it.
# Not Cargo.toml either: cargo rebuilds only when what it says changes, not for its date.
# The pages' date (date= below): the day the binary was built, or SOURCE_DATE_EPOCH's
# (reproducible builds).
install:
	@test -x "$(BIN)" || { echo "make install: $(BIN) is missing: run \`make\` first" >&2; exit 1; }
	@test -f "$(PRELOAD)" || { echo "make install: $(PRELOAD) is missing: run \`make\` first" >&2; exit 1; }
	@for art in "$(BIN)" "$(PRELOAD)"; do \
		dep=$${art%.so}.d; \
		sources=$$(sed 's/^[^:]*://' "$$dep" 2>/dev/null) || sources=$$(find src preload/src record/src -type f); \
		for f in $$sources; do \
			if [ "$$f" -nt "$$art" ]; then \
				echo "make install: $$art is older than $$f: run \`make\` first" >&2; exit 1; \
			fi; \
		done; \
	done
	umask 022 && \
	install -d "$(DESTDIR)$(bindir)" "$(DESTDIR)$(libdir)" "$(DESTDIR)$(man1dir)" "$(DESTDIR)$(bashcompdir)" \
		"$(DESTDIR)$(zshcompdir)" "$(DESTDIR)$(fishcompdir)" && \
	install -m 755 "$(BIN)" "$(DESTDIR)$(bindir)/lightfoot" && \
	install -m 644 "$(PRELOAD)" "$(DESTDIR)$(libdir)/liblightfoot_preload.so" && \
	date=$$(date -u -d "@$${SOURCE_DATE_EPOCH:-$$(stat -c %Y "$(BIN)")}" +%F) && \
	"$(BIN)" __generate man --date "$$date" "$(DESTDIR)$(man1dir)" && \
	"$(BIN)" __generate completion bash > "$(DESTDIR)$(bashcompdir)/lightfoot" && \
	"$(BIN)" __generate completion zsh > "$(DESTDIR)$(zshcompdir)/_lightfoot" && \
	"$(BIN)" __generate completion fish > "$(DESTDIR)$(fishcompdir)/lightfoot.fish"

uninstall:
	rm -f "$(DESTDIR)$(libdir)/liblightfoot_preload.so"
	-rmdir "$(DESTDIR)$(libdir)" 2>/dev/null
	rm -f "$(DESTDIR)$(bindir)/lightfoot" \
		"$(DESTDIR)$(man1dir)"/lightfoot.1 "$(DESTDIR)$(man1dir)"/lightfoot-*.1 \
		"$(DESTDIR)$(bashcompdir)/lightfoot" "$(DESTDIR)$(zshcompdir)/_lightfoot" \
		"$(DESTDIR)$(fishcompdir)/lightfoot.fish"

deps:
	./scripts/install-deps.sh

# Release mode: the integration tests copy tens of MiB, and the cache behaviour under test
# is the one users get. A test that cannot run here (no root, a tool or a kernel feature
# missing) passes in cargo's count: each skip writes a line to SKIP_LOG (tests/common/mod.rs,
# `skip`), and the run ends with how many tests skipped and why, whether the tests passed or
# failed. The exit status is cargo test's.
SKIP_LOG = $(abspath $(or $(CARGO_TARGET_DIR),target))/test-skips.log

test: deps
	./scripts/build-seaweedfs.sh >/dev/null
	$(CARGO) build --release --all-targets
	@: > "$(SKIP_LOG)"
	LIGHTFOOT_SKIP_LOG="$(SKIP_LOG)" $(CARGO) test --release -- --test-threads=2; \
	status=$$?; ./scripts/skip-summary.sh "$(SKIP_LOG)"; exit $$status

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings

# Fuzzing, by hand (`make test` only replays the kept inputs, in tests/fuzz_replay.rs): each
# target for FUZZ_TIME seconds with one worker, on nightly (`cargo install cargo-fuzz`). New
# corpus entries land in fuzz/corpus/<target>, crashes in fuzz/artifacts/<target>
# (docs/fuzzing.md says what to do with them).
FUZZ_TIME ?= 300
FUZZ_TARGETS ?= handshake request connection bitmap s3_records

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
