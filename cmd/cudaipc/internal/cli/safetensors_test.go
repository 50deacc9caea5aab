package cli

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/bundle"
)

// stTensor is a tensor of a test safetensors file.
type stTensor struct {
	name  string
	dtype bundle.DType
	shape []int64
	data  []byte
}

// writeSafetensors writes a dense safetensors file of tensors, in order,
// the way the safetensors library does (header padded to 8 bytes).
func writeSafetensors(t *testing.T, path string, tensors []stTensor, meta map[string]string) {
	t.Helper()
	var specs []bundle.Spec
	for _, x := range tensors {
		specs = append(specs, bundle.Spec{Name: x.name, DType: x.dtype, Shape: x.shape})
	}
	m, _, err := bundle.Layout(specs, 1, meta)
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	if err := bundle.WriteHeader(&b, m.Marshal()); err != nil {
		t.Fatal(err)
	}
	for _, x := range tensors {
		b.Write(x.data)
	}
	if err := os.WriteFile(path, b.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
}

func randomTensor(name string, d bundle.DType, shape ...int64) stTensor {
	n, err := bundle.ByteSize(d, shape)
	if err != nil {
		panic(err)
	}
	data := make([]byte, n)
	rand.Read(data)
	return stTensor{name, d, shape, data}
}

// readSafetensors checks that path is a valid (dense) safetensors file
// and returns its tensors by name.
func readSafetensors(t *testing.T, path string) (map[string]stTensor, map[string]string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, _ := f.Stat()
	h, start, err := bundle.ReadHeader(f)
	if err != nil {
		t.Fatal(err)
	}
	m, err := bundle.Parse(h)
	if err != nil {
		t.Fatal(err)
	}
	if !m.Dense() || m.DataSize() != st.Size()-start {
		t.Fatalf("%s: not a dense safetensors file", path)
	}
	out := map[string]stTensor{}
	for _, x := range m.Tensors {
		data := make([]byte, x.Size())
		if _, err := f.ReadAt(data, start+x.Begin); err != nil {
			t.Fatal(err)
		}
		out[x.Name] = stTensor{x.Name, x.DType, x.Shape, data}
	}
	return out, m.Metadata
}

func sameTensors(t *testing.T, got map[string]stTensor, want []stTensor) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%d tensors, want %d", len(got), len(want))
	}
	for _, w := range want {
		g, ok := got[w.name]
		if !ok || g.dtype != w.dtype || fmt.Sprint(g.shape) != fmt.Sprint(w.shape) || !bytes.Equal(g.data, w.data) {
			t.Fatalf("tensor %s differs", w.name)
		}
	}
}

func TestSafetensorsRoundTrip(t *testing.T) {
	sock := serve(t)
	dir := t.TempDir()

	// Aligned: every tensor a multiple of 256 bytes, so every offset is.
	aligned := []stTensor{
		randomTensor("model.embed_tokens.weight", bundle.BF16, 64, 128),
		randomTensor("model.norm.weight", bundle.F32, 64),
		randomTensor("lm_head.weight", bundle.F16, 128, 64),
	}
	in := filepath.Join(dir, "aligned.safetensors")
	writeSafetensors(t, in, aligned, map[string]string{"format": "pt"})
	out := mustRun(t, "put", in, "--name", "aligned", "--socket", sock)
	if !strings.Contains(out, "3 tensors") {
		t.Errorf("put said %q", out)
	}
	got := filepath.Join(dir, "aligned.out.safetensors")
	wrote := mustRun(t, "get", "aligned", "-o", got, "--socket", sock)
	a, _ := os.ReadFile(in)
	b, _ := os.ReadFile(got)
	if !bytes.Equal(a, b) {
		t.Fatalf("aligned file: got back %d bytes, not byte-identical to the %d put", len(b), len(a))
	}
	if !strings.Contains(wrote, fmt.Sprintf(", %d bytes,", len(b))) {
		t.Errorf("get of a %d-byte file said %q", len(b), wrote)
	}

	// Every dtype, odd sizes: laid out anew, got back tensor for tensor.
	var every []stTensor
	for i, d := range bundle.DTypes {
		every = append(every, randomTensor(fmt.Sprintf("t.%d.%s", i, d), d, int64(1+i%3), 8))
	}
	every = append(every, randomTensor("scalar", bundle.F64), randomTensor("empty", bundle.BF16, 0, 3))
	in = filepath.Join(dir, "every.safetensors")
	writeSafetensors(t, in, every, map[string]string{"k": "v"})
	mustRun(t, "put", in, "--name", "every", "--socket", sock)
	got = filepath.Join(dir, "every.out.safetensors")
	wrote = mustRun(t, "get", "every", "-o", got, "--socket", sock)
	tensors, meta := readSafetensors(t, got)
	if fi, err := os.Stat(got); err != nil || !strings.Contains(wrote, fmt.Sprintf(", %d bytes,", fi.Size())) {
		t.Errorf("get of a re-laid-out bundle said %q for a file of %v bytes (%v)", wrote, fi.Size(), err)
	}
	sameTensors(t, tensors, every)
	if meta["k"] != "v" {
		t.Errorf("metadata %v", meta)
	}
	// The bundle itself is aligned: --raw shows its padded layout.
	var info struct {
		Tensors      int   `json:"tensors"`
		ManifestSize int64 `json:"manifest_size"`
		Size         int64 `json:"size"`
	}
	if err := json.Unmarshal([]byte(mustRun(t, "stat", "every", "--json", "--socket", sock)), &info); err != nil {
		t.Fatal(err)
	}
	if info.Tensors != len(every) || info.ManifestSize == 0 || info.Size%bundle.Alignment == 0 && info.Size < int64(len(every))*bundle.Alignment-bundle.Alignment {
		t.Errorf("stat: %+v", info)
	}

	// A sharded checkpoint: a directory with its index.
	shards := filepath.Join(dir, "ckpt")
	os.Mkdir(shards, 0o700)
	s1 := []stTensor{randomTensor("a", bundle.BF16, 3, 5), randomTensor("b", bundle.I64, 7)}
	s2 := []stTensor{randomTensor("c", bundle.U8, 13)}
	writeSafetensors(t, filepath.Join(shards, "model-00001-of-00002.safetensors"), s1, nil)
	writeSafetensors(t, filepath.Join(shards, "model-00002-of-00002.safetensors"), s2, nil)
	index := `{"metadata":{"total_size":147},"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00001-of-00002.safetensors","c":"model-00002-of-00002.safetensors"}}`
	os.WriteFile(filepath.Join(shards, "model.safetensors.index.json"), []byte(index), 0o600)
	mustRun(t, "put", shards, "--name", "ckpt", "--socket", sock)
	got = filepath.Join(dir, "ckpt.safetensors")
	mustRun(t, "get", "ckpt", "-o", got, "--socket", sock)
	tensors, meta = readSafetensors(t, got)
	sameTensors(t, tensors, append(s1, s2...))
	if meta["total_size"] != "147" {
		t.Errorf("metadata %v", meta)
	}

	// Versions from the command line.
	for v := 1; v <= 2; v++ {
		out := mustRun(t, "put", in, "--name", "versioned", "--publish", "--socket", sock)
		if !strings.Contains(out, fmt.Sprintf("version %d", v)) {
			t.Errorf("put --publish said %q", out)
		}
	}

	// Not a safetensors file.
	bad := filepath.Join(dir, "bad.safetensors")
	os.WriteFile(bad, []byte("not a safetensors file at all"), 0o600)
	if _, _, err := storeCLI(t, "put", bad, "--name", "bad", "--socket", sock); err == nil || !strings.Contains(err.Error(), "safetensors") {
		t.Errorf("put of a bad file: %v", err)
	}
}

// get --tensors writes a safetensors file of just the named tensors, with
// the bundle's metadata; an unknown name fails naming it.
func TestGetTensors(t *testing.T) {
	sock := serve(t)
	dir := t.TempDir()
	tensors := []stTensor{
		randomTensor("a", bundle.BF16, 64, 129),
		randomTensor("b", bundle.F32, 7),
		randomTensor("c", bundle.U8, 1000),
	}
	in := filepath.Join(dir, "m.safetensors")
	writeSafetensors(t, in, tensors, map[string]string{"format": "pt"})
	mustRun(t, "put", in, "--name", "m", "--socket", sock)
	got := filepath.Join(dir, "sub.safetensors")
	mustRun(t, "get", "m", "--tensors", "c,a", "-o", got, "--socket", sock)
	sub, meta := readSafetensors(t, got)
	sameTensors(t, sub, []stTensor{tensors[0], tensors[2]})
	if meta["format"] != "pt" {
		t.Errorf("metadata %v", meta)
	}
	if _, _, err := storeCLI(t, "get", "m", "--tensors", "a,nope", "-o", got, "--socket", sock); err == nil || !strings.Contains(err.Error(), `"nope"`) {
		t.Errorf("an unknown tensor: %v", err)
	}
	if _, _, err := storeCLI(t, "get", "m", "--tensors", "a", "--raw", "-o", got, "--socket", sock); err == nil || !strings.Contains(err.Error(), "--raw") {
		t.Errorf("--raw with --tensors: %v", err)
	}
}
