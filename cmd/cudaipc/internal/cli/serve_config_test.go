package cli

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/cudaipc/cudaipc/internal/bytesize"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// writeConfig writes text to a config file of the test and returns its path.
func writeConfig(t *testing.T, text string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "serve.toml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// printedConfig runs 'serve --print-config' with args and decodes what it
// printed.
func printedConfig(t *testing.T, args ...string) (daemonConfig, string, string) {
	t.Helper()
	out, errOut, err := storeCLI(t, append([]string{"serve", "--print-config"}, args...)...)
	if err != nil {
		t.Fatalf("serve --print-config %s: %v\n%s", strings.Join(args, " "), err, errOut)
	}
	var cfg daemonConfig
	md, err := toml.Decode(out, &cfg)
	if err != nil {
		t.Fatalf("printed config does not decode: %v\n%s", err, out)
	}
	if u := md.Undecoded(); len(u) > 0 {
		t.Fatalf("printed config has keys the loader does not know: %v", u)
	}
	return cfg, out, errOut
}

// Without a file or flags serve runs with the defaults; a file overrides
// them, and flags override the file.
func TestConfigPrecedence(t *testing.T) {
	def, _, _ := printedConfig(t)
	if want := defaultConfig(); !reflect.DeepEqual(def, want) {
		t.Fatalf("defaults printed as\n%+v\nwant\n%+v", def, want)
	}
	file := writeConfig(t, `
capacity = "3GiB"
backend = "host"
max-conns = 77
evict = false
allow-uid = [1001, 1002]
experimental-spin = "0s"
experimental-keep-arenas = 0
experimental-cluster-lanes = 2
`)
	got, _, _ := printedConfig(t, "--config", file)
	want := defaultConfig()
	want.Capacity = 3 << 30
	want.Backend = "host"
	want.MaxConns = 77
	want.Evict = false
	want.AllowUID = []uint32{1001, 1002}
	want.Spin = 0
	want.KeepArenas = 0
	want.ClusterLanes = 2
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("file applied as\n%+v\nwant\n%+v", got, want)
	}

	got, _, _ = printedConfig(t, "--config", file, "--capacity", "5MiB", "--allow-uid", "7", "--experimental-cluster-lanes", "3", "--cluster-listen", "127.0.0.1:0")
	want.Capacity = 5 << 20
	want.AllowUID = []uint32{7}
	want.ClusterLanes = 3
	want.ClusterListen = "127.0.0.1:0"
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("flags over the file gave\n%+v\nwant\n%+v", got, want)
	}
	if sc := got.storeConfig(); sc.Capacity != 5<<20 || sc.MaxConns != 77 || !sc.NoEvict || sc.Spin >= 0 || sc.KeepArenas >= 0 {
		t.Errorf("store configuration %+v", sc)
	}
}

// What --print-config prints loads back to the same configuration and
// prints the same again, so an operator can start a file from it.
func TestPrintConfigRoundTrip(t *testing.T) {
	file := writeConfig(t, `
gpu-share = "fd"
quota = "1536KiB"
metrics = ":9464"
allow-gid = [44]
cluster-prefix = "/other/"
experimental-spin = "120us"
experimental-keep-arenas = "64MiB"
experimental-cluster-chunk = "16MiB"
experimental-cluster-read = "get"
`)
	first, printed, _ := printedConfig(t, "--config", file, "--node", "n1", "--capacity", "4097")
	if first.Quota != 1536<<10 || first.Spin != 120*time.Microsecond || first.KeepArenas != 64<<20 || first.Capacity != 4097 || first.Node != "n1" {
		t.Fatalf("settings %+v", first)
	}
	again, reprinted, _ := printedConfig(t, "--config", writeConfig(t, printed))
	if !reflect.DeepEqual(first, again) {
		t.Fatalf("printed config loads as\n%+v\nwant\n%+v", again, first)
	}
	if reprinted != printed {
		t.Errorf("printing the printed config differs:\n%s\nwant\n%s", reprinted, printed)
	}
	for _, key := range settingKeys() {
		if !regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(key) + ` = `).MatchString(printed) {
			t.Errorf("--print-config lacks %s", key)
		}
	}
}

// settingKeys are the keys of every setting.
func settingKeys() []string {
	var keys []string
	typ := reflect.TypeFor[daemonConfig]()
	for i := range typ.NumField() {
		keys = append(keys, typ.Field(i).Tag.Get("toml"))
	}
	return keys
}

// A file with a key that names no setting, or a value a setting cannot
// take, stops serve before it starts, with one line naming what is wrong.
func TestConfigErrors(t *testing.T) {
	for _, c := range []struct {
		file, want string
	}{
		{`capcity = "1GiB"`, `unknown setting "capcity"`},
		{"[cluster]\nlisten = \":7946\"", `(last key "cluster"): incompatible types`},
		{"[limits]\nmax-conns = 1", `unknown setting "limits`},
		{`capacity = "4XB"`, `bad size "4XB"`},
		{`capacity = -5`, `bad size "-5"`},
		{`backend = "gpu"`, `backend = "gpu": want auto or cuda or host`},
		{`evict = "yes"`, `evict`},
		{`max-conns = -1`, `max-conns = -1: want 0 or more`},
		{`experimental-cluster-chunk = "3MiB"`, `experimental-cluster-chunk = 3 MiB: want 0 (the default) or a power of two`},
		{`experimental-cluster-streams = 65`, `experimental-cluster-streams = 65: want 0 (the default) to 64`},
		{`experimental-cluster-lanes = 17`, `experimental-cluster-lanes = 17: want 0 (one) to 16`},
		{`experimental-keep-arenas = "all"`, `or capacity`},
		{`experimental-spin = "fast"`, `experimental-spin`},
		{`capacity = `, `serve.toml`},
	} {
		path := writeConfig(t, c.file)
		_, _, err := storeCLI(t, "serve", "--config", path, "--socket", filepath.Join(t.TempDir(), "s.sock"))
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: err %v, want one line with %q", c.file, err, c.want)
			continue
		}
		if !errors.Is(err, ErrConfig) {
			t.Errorf("%s: %v is not ErrConfig", c.file, err)
		}
		if strings.HasPrefix(c.want, "unknown") && !strings.Contains(err.Error(), path) {
			t.Errorf("%s: %v does not name the file", c.file, err)
		}
	}
	if _, _, err := storeCLI(t, "serve", "--config", filepath.Join(t.TempDir(), "absent.toml")); err == nil || !strings.Contains(err.Error(), "absent.toml") {
		t.Errorf("a missing file: %v", err)
	}
}

// serve --help lists the flags an operator picks, at most 15 of its own;
// the experimental and the deprecated flags stay out of it.
func TestServeHelpFlags(t *testing.T) {
	out, _, err := storeCLI(t, "serve", "--help")
	if err != nil {
		t.Fatal(err)
	}
	global := map[string]bool{"help": true, "socket": true, "log-level": true, "version": true}
	var own []string
	for _, m := range regexp.MustCompile(`(?m)^  (?:-\w, |    )--([a-z0-9-]+)`).FindAllStringSubmatch(out, -1) {
		if !global[m[1]] {
			own = append(own, m[1])
		}
	}
	if len(own) == 0 || len(own) > 15 {
		t.Errorf("serve --help lists %d flags of its own, want 1 to 15: %v", len(own), own)
	}
	for _, f := range own {
		if strings.HasPrefix(f, "experimental-") || f == "metrics" || f == "max-conns" {
			t.Errorf("serve --help lists --%s", f)
		}
	}
	for _, history := range []string{"versions before", "earlier version", "older"} {
		if strings.Contains(out, history) {
			t.Errorf("serve --help tells history (%q):\n%s", history, out)
		}
	}
}

// A deprecated flag still sets its setting, with a warning that names
// the setting of the file.
func TestServeDeprecatedFlag(t *testing.T) {
	got, _, errOut := printedConfig(t, "--max-conns", "9", "--no-evict", "--metrics", "9464")
	if got.MaxConns != 9 || got.Evict || got.Metrics != "9464" {
		t.Errorf("deprecated flags gave %+v", got)
	}
	for _, want := range []string{"serve --max-conns is deprecated: set max-conns in the file of --config", "evict = false", "set metrics"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("no warning %q in\n%s", want, errOut)
		}
	}
}

// A daemon started with a config file runs with its settings: a capacity
// of 1 MiB refuses an object of 2 MiB that the default capacity takes.
func TestServeConfigCapacity(t *testing.T) {
	sock := serve(t, "--backend", "host", "--config", writeConfig(t, "capacity = \"1MiB\"\nevict = false\n"))
	dir := t.TempDir()
	small := testutil.RandomBytes(uint64(time.Now().UnixNano()), 512<<10)
	big := testutil.RandomBytes(uint64(time.Now().UnixNano())+1, 2<<20)
	for name, data := range map[string][]byte{"small": small, "big": big} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	mustRun(t, "put", filepath.Join(dir, "small"), "--name", "small", "--socket", sock)
	_, _, err := storeCLI(t, "put", filepath.Join(dir, "big"), "--name", "big", "--socket", sock)
	if ExitCode(err) != ExitStoreFull {
		t.Fatalf("put of 2 MiB into a capacity of 1 MiB: exit %d, %v", ExitCode(err), err)
	}
	var out bytes.Buffer
	if err := runIO(context.Background(), []string{"get", "small", "-o", "-", "--socket", sock}, strings.NewReader(""), &out, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(out.Bytes(), small) {
		t.Fatalf("get small: %d bytes differ from the %d put", out.Len(), len(small))
	}

	// The same object fits a daemon of the default capacity.
	sock = serve(t, "--backend", "host")
	mustRun(t, "put", filepath.Join(dir, "big"), "--name", "big", "--socket", sock)
	if bytesize.Size(defaultConfig().Capacity) < 2<<20 {
		t.Fatal("the default capacity is below 2 MiB")
	}
}

// docs/configuration.md has a row for every setting, and no row for a
// setting that does not exist.
func TestConfigDocumented(t *testing.T) {
	doc, err := os.ReadFile("../../../../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `([a-z0-9-]+)` \\|").FindAllStringSubmatch(string(doc), -1) {
		rows[m[1]] = true
	}
	for _, key := range settingKeys() {
		if !rows[key] {
			t.Errorf("docs/configuration.md has no row for %s", key)
		}
		delete(rows, key)
	}
	for key := range rows {
		t.Errorf("docs/configuration.md has a row for %s, which is no setting", key)
	}
}

// experimental-keep-arenas and experimental-spin reach the store in its
// own terms: "capacity" is its 0, a 0 of the setting its "none".
func TestStoreConfigMapping(t *testing.T) {
	for k, want := range map[keptBytes]int64{keepCapacity: 0, 0: -1, 64 << 20: 64 << 20} {
		if got := storeKeepArenas(k); got != want {
			t.Errorf("storeKeepArenas(%d) = %d, want %d", k, got, want)
		}
	}
	for d, want := range map[time.Duration]time.Duration{0: -1, 50 * time.Microsecond: 50 * time.Microsecond} {
		if got := storeSpin(d); got != want {
			t.Errorf("storeSpin(%v) = %v, want %v", d, got, want)
		}
	}
}
