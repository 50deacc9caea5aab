package cu

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// The entry points issue 11 builds on are in the table, optional.
func TestEntryPointTable(t *testing.T) {
	byName := map[string]entry{}
	for _, e := range entries {
		if _, dup := byName[e.name]; dup {
			t.Fatalf("%s twice", e.name)
		}
		if !strings.HasPrefix(e.symbol, e.name) {
			t.Errorf("%s: symbol %s", e.name, e.symbol)
		}
		byName[e.name] = e
	}
	for name, symbol := range map[string]string{
		"cuMemRetainAllocationHandle":            "cuMemRetainAllocationHandle",
		"cuMemGetAddressRange":                   "cuMemGetAddressRange_v2",
		"cuPointerGetAttribute":                  "cuPointerGetAttribute",
		"cuPointerGetAttributes":                 "cuPointerGetAttributes",
		"cuMemGetAllocationPropertiesFromHandle": "cuMemGetAllocationPropertiesFromHandle",
		"cuStreamWriteValue64":                   "cuStreamWriteValue64_v2",
		"cuStreamWaitValue64":                    "cuStreamWaitValue64_v2",
		"cuMemHostRegister":                      "cuMemHostRegister_v2",
		"cuMemHostUnregister":                    "cuMemHostUnregister",
	} {
		e, ok := byName[name]
		if !ok || e.required || e.symbol != symbol {
			t.Errorf("%s: %+v, want optional with symbol %s", name, e, symbol)
		}
	}
}

func TestMissingOptionalEntryPoint(t *testing.T) {
	err := missing("cuStreamWriteValue64", "cuStreamWriteValue64_v2")
	var me *MissingError
	if !errors.As(err, &me) || !errors.Is(err, ErrorNotSupported) || errors.Is(err, ErrNoDriver) ||
		!strings.Contains(err.Error(), "cuStreamWriteValue64: the driver library") || !strings.Contains(err.Error(), "lacks cuStreamWriteValue64_v2") {
		t.Fatalf("%v", err)
	}
}

// EnvStubRole makes the test binary, re-executed by
// TestLoadWithoutOptionalEntryPoints, load the stub library and report.
const envStubRole = "CUDAIPC_CU_STUB_ROLE"

func TestMain(m *testing.M) {
	if os.Getenv(envStubRole) != "" {
		os.Exit(stubRole())
	}
	os.Exit(m.Run())
}

func stubRole() int {
	if err := Load(); err != nil {
		fmt.Println("load:", err)
		return 1
	}
	if !Has("cuInit") || Has("cuStreamWriteValue64") || Has("cuNoSuchCall") {
		fmt.Println("Has is wrong")
		return 1
	}
	err := StreamWriteValue64(0, 0, 1, 0)
	if !errors.Is(err, ErrorNotSupported) || !strings.Contains(err.Error(), "lacks cuStreamWriteValue64_v2") {
		fmt.Println("missing optional call:", err)
		return 1
	}
	if err := StreamSynchronize(0); err != nil { // the stub's required calls return CUDA_SUCCESS
		fmt.Println("required call:", err)
		return 1
	}
	fmt.Println("ok")
	return 0
}

// TestLoadWithoutOptionalEntryPoints builds a stub driver library that
// exports only the required entry points (each returning CUDA_SUCCESS) and
// loads it in a child process: the load succeeds, an optional call fails
// with a *MissingError, and a library lacking a required one fails to load
// naming the symbol.
func TestLoadWithoutOptionalEntryPoints(t *testing.T) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skip("no C compiler to build a stub driver library")
	}
	build := func(name string, keep func(entry) bool) string {
		var src strings.Builder
		for _, e := range entries {
			if keep(e) {
				fmt.Fprintf(&src, "int %s(void) { return 0; }\n", e.symbol)
			}
		}
		dir := t.TempDir()
		c, so := filepath.Join(dir, name+".c"), filepath.Join(dir, name+".so")
		if err := os.WriteFile(c, []byte(src.String()), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command(cc, "-shared", "-fPIC", "-o", so, c).CombinedOutput(); err != nil {
			t.Skipf("cannot build a shared library: %v\n%s", err, out)
		}
		return so
	}
	run := func(lib string) (string, error) {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), envStubRole+"=1", EnvLibrary+"="+lib)
		out, err := cmd.CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	out, err := run(build("required", func(e entry) bool { return e.required }))
	if err != nil || out != "ok" {
		t.Fatalf("stub without optional entry points: %v: %s", err, out)
	}
	out, err = run(build("lacking", func(e entry) bool { return e.required && e.name != "cuMemMap" }))
	if err == nil || !strings.Contains(out, "lacks cuMemMap") {
		t.Fatalf("stub without cuMemMap: %v: %s", err, out)
	}
}
