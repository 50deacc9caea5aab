// Command gen writes zentrypoints.go from entrypoints.txt: the raw layer's
// loader fields and table, one trampoline per driver entry point (cuX,
// calling the entry point through purego and returning its Result) and
// one typed wrapper (callX, returning an error that names the call). It is
// run by `go generate` in internal/cu and needs nothing but Go.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"go/format"
	"log"
	"os"
	"regexp"
	"strings"
)

// goTypes maps the C types of entrypoints.txt (pointers written with '*'
// after the type, "const" dropped) to the raw layer's Go types.
var goTypes = map[string]string{
	"unsigned int":                     "uint32",
	"int":                              "int32",
	"int*":                             "*int32",
	"unsigned char":                    "uint8",
	"size_t":                           "uint64",
	"size_t*":                          "*uint64",
	"unsigned long long":               "uint64",
	"cuuint64_t":                       "uint64",
	"float*":                           "*float32",
	"char*":                            "*byte",
	"void*":                            "unsafe.Pointer",
	"void**":                           "*unsafe.Pointer",
	"CUdevice":                         "Device",
	"CUdevice*":                        "*Device",
	"CUuuid*":                          "*[16]byte",
	"CUcontext":                        "Context",
	"CUcontext*":                       "*Context",
	"CUstream":                         "Stream",
	"CUstream*":                        "*Stream",
	"CUevent":                          "Event",
	"CUevent*":                         "*Event",
	"CUmodule":                         "Module",
	"CUmodule*":                        "*Module",
	"CUfunction":                       "Function",
	"CUfunction*":                      "*Function",
	"CUdeviceptr":                      "DevicePtr",
	"CUdeviceptr*":                     "*DevicePtr",
	"CUdevice_attribute":               "DeviceAttribute",
	"CUpointer_attribute":              "PointerAttribute",
	"CUpointer_attribute*":             "*PointerAttribute",
	"CUipcMemHandle":                   "IpcMemHandle",
	"CUipcMemHandle*":                  "*IpcMemHandle",
	"CUipcEventHandle":                 "IpcEventHandle",
	"CUipcEventHandle*":                "*IpcEventHandle",
	"CUmemGenericAllocationHandle":     "MemGenericAllocationHandle",
	"CUmemGenericAllocationHandle*":    "*MemGenericAllocationHandle",
	"CUmemAllocationProp*":             "*MemAllocationProp",
	"CUmemAccessDesc*":                 "*MemAccessDesc",
	"CUmemAllocationHandleType":        "MemHandleType",
	"CUmemAllocationGranularity_flags": "MemAllocGranularityFlags",
}

// byValue are the Go types passed to the driver by value as structs: those
// calls go through a purego.RegisterFunc binding, which lays them out per
// the platform ABI; every other call goes through purego.SyscallN.
var byValue = map[string]bool{"IpcMemHandle": true, "IpcEventHandle": true}

type param struct{ name, goType string }

type entry struct {
	name, symbol string
	required     bool
	params       []param
	decl         string
}

var declRE = regexp.MustCompile(`^CUresult\s+(cu\w+)\s*\((.*)\)\s*;?$`)

func parse(path string) ([]entry, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []entry
	seen := map[string]bool{}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) < 3 {
			return nil, fmt.Errorf("%s:%d: want need, symbol and declaration", path, n)
		}
		var e entry
		switch fields[0] {
		case "required":
			e.required = true
		case "optional":
		default:
			return nil, fmt.Errorf("%s:%d: need is %q, want required or optional", path, n, fields[0])
		}
		e.symbol = fields[1]
		e.decl = strings.TrimSpace(line[strings.Index(line, fields[1])+len(fields[1]):])
		m := declRE.FindStringSubmatch(e.decl)
		if m == nil {
			return nil, fmt.Errorf("%s:%d: %q is not a declaration \"CUresult cuX(...)\"", path, n, e.decl)
		}
		e.name = m[1]
		if !strings.HasPrefix(e.symbol, e.name) {
			return nil, fmt.Errorf("%s:%d: symbol %s is not a version of %s", path, n, e.symbol, e.name)
		}
		if seen[e.name] {
			return nil, fmt.Errorf("%s:%d: %s twice", path, n, e.name)
		}
		seen[e.name] = true
		if e.params, err = parseParams(m[2]); err != nil {
			return nil, fmt.Errorf("%s:%d: %s: %v", path, n, e.name, err)
		}
		out = append(out, e)
	}
	return out, sc.Err()
}

var overrideRE = regexp.MustCompile(`/\*go:(.+?)\*/`)

func parseParams(s string) ([]param, error) {
	s = strings.TrimSpace(s)
	if s == "" || s == "void" {
		return nil, nil
	}
	var out []param
	for _, p := range strings.Split(s, ",") {
		override := ""
		if m := overrideRE.FindStringSubmatch(p); m != nil {
			override = strings.TrimSpace(m[1])
			p = overrideRE.ReplaceAllString(p, "")
		}
		p = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(p), "const "))
		i := strings.LastIndexAny(p, " *")
		if i < 0 {
			return nil, fmt.Errorf("parameter %q has no name", p)
		}
		name, ctype := p[i+1:], strings.TrimSpace(p[:i+1])
		ctype = strings.Join(strings.Fields(strings.ReplaceAll(ctype, "*", " * ")), " ")
		ctype = strings.ReplaceAll(ctype, " *", "*")
		gt := override
		if gt == "" {
			var ok bool
			if gt, ok = goTypes[ctype]; !ok {
				return nil, fmt.Errorf("no Go type for C type %q (add it to goTypes)", ctype)
			}
		}
		out = append(out, param{goName(name), gt})
	}
	return out, nil
}

// goName avoids the Go keywords and predeclared names C parameters use.
func goName(s string) string {
	switch s {
	case "len", "free", "type", "func", "range", "map":
		return s + "_"
	}
	return s
}

// arg converts a parameter to the uintptr SyscallN takes; pointers are
// converted inside the call expression, where //go:uintptrescapes keeps
// what they point to alive and in place.
func arg(p param) string {
	switch {
	case p.goType == "unsafe.Pointer", p.goType == "uintptr":
		return "uintptr(" + p.name + ")"
	case strings.HasPrefix(p.goType, "*"):
		return "uintptr(unsafe.Pointer(" + p.name + "))"
	}
	return "uintptr(" + p.name + ")"
}

func generate(entries []entry) ([]byte, error) {
	var b bytes.Buffer
	w := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	w("// Code generated by gen/main.go from entrypoints.txt; DO NOT EDIT.\n\n")
	w("package cu\n\nimport (\n\t\"unsafe\"\n\n\t\"github.com/ebitengine/purego\"\n)\n\n")
	w("// procs holds the address of each entry point, 0 for an optional one the\n// library lacks.\nvar procs struct {\n")
	for _, e := range entries {
		w("\t%s uintptr\n", e.name)
	}
	w("}\n\n")
	w("// Bindings for the calls that pass a struct by value.\nvar (\n")
	for _, e := range entries {
		if structArg(e) {
			w("\t%sFn func(%s) Result\n", e.name, sig(e))
		}
	}
	w(")\n\n")
	w("// entries is the loader's table, in entrypoints.txt's order.\nvar entries = []entry{\n")
	for _, e := range entries {
		fn := "nil"
		if structArg(e) {
			fn = "&" + e.name + "Fn"
		}
		w("\t{%q, %q, %v, %s, &procs.%s},\n", e.name, e.symbol, e.required, fn, e.name)
	}
	w("}\n\n")
	for _, e := range entries {
		var names, args []string
		for _, p := range e.params {
			names = append(names, p.name)
			args = append(args, arg(p))
		}
		w("// %s is the trampoline of %s.\n", e.name, e.decl)
		w("func %s(%s) Result {\n", e.name, sig(e))
		if structArg(e) {
			w("\treturn %sFn(%s)\n}\n\n", e.name, strings.Join(names, ", "))
		} else {
			w("\tr, _, _ := purego.SyscallN(%s)\n\treturn Result(int32(r))\n}\n\n", strings.Join(append([]string{"procs." + e.name}, args...), ", "))
		}
		need := "required"
		if !e.required {
			need = "optional"
		}
		w("// call%s calls %s (%s, symbol %s).\n", e.name[2:], e.name, need, e.symbol)
		w("func call%s(%s) error {\n", e.name[2:], sig(e))
		w("\tif err := loaded(%q); err != nil {\n\t\treturn err\n\t}\n", e.name)
		if !e.required {
			w("\tif procs.%s == 0 {\n\t\treturn missing(%q, %q)\n\t}\n", e.name, e.name, e.symbol)
		}
		w("\treturn check(%q, %s(%s))\n}\n\n", e.name, e.name, strings.Join(names, ", "))
	}
	return format.Source(b.Bytes())
}

func structArg(e entry) bool {
	for _, p := range e.params {
		if byValue[p.goType] {
			return true
		}
	}
	return false
}

func sig(e entry) string {
	var s []string
	for _, p := range e.params {
		s = append(s, p.name+" "+p.goType)
	}
	return strings.Join(s, ", ")
}

func main() {
	in := flag.String("in", "entrypoints.txt", "the table of entry points")
	out := flag.String("out", "zentrypoints.go", "the Go file to write")
	flag.Parse()
	entries, err := parse(*in)
	if err != nil {
		log.Fatal(err)
	}
	src, err := generate(entries)
	if err != nil {
		log.Fatal(err)
	}
	if err := os.WriteFile(*out, src, 0o644); err != nil {
		log.Fatal(err)
	}
}
