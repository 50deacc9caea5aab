package cli

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/bytesize"
	"github.com/cudaipc/cudaipc/protocol"
)

// maxUnsizedInput bounds what put reads into memory from an input whose
// size it cannot know in advance (a pipe without --size): an object's size
// is fixed when it is created, so such input is read before the create.
const maxUnsizedInput = 64 << 20

type putCmd struct {
	File    string        `arg:"" help:"File to store, or - for standard input." placeholder:"FILE|-"`
	Name    string        `required:"" help:"Name of the new object." placeholder:"NAME"`
	Size    bytesize.Size `help:"Size of the object in bytes (4096, 16MiB, 1G). Needed to stream a pipe longer than 64 MiB; from a device such as /dev/urandom put stores the first SIZE bytes. A regular file must have exactly SIZE bytes." placeholder:"SIZE"`
	Device  string        `default:"host" help:"Where the object's memory lives: host, a GPU ordinal (of this process, resolved to its UUID) or a GPU UUID; GPUs need a daemon with the cuda backend (default ${default})." placeholder:"host|ORDINAL|UUID"`
	Shared  bool          `help:"Let every user the daemon admits read the object (default: only your uid)."`
	DType   string        `name:"dtype" help:"Record what the bytes are as a typed array: the element type (float32, bfloat16, uint8, ...); readers such as the Python client view the object with it." placeholder:"DTYPE"`
	Shape   []int64       `help:"With --dtype: the array's shape, comma-separated (default: one dimension covering the input)." placeholder:"N,M,..."`
	Strides []int64       `help:"With --dtype: strides in elements, comma-separated (default: C order)." placeholder:"S,T,..."`
	Publish bool          `help:"Store it as the next version of the versioned name NAME (readers get the latest; older versions go when no longer leased)."`
	Raw     bool          `help:"Store a .safetensors file as plain bytes, not as a bundle of tensors."`
	Cluster bool          `help:"Make the object cluster-visible: other daemons of the cluster ('serve --cluster') can read it (a host object, or a host bundle from a .safetensors file)."`
}

func (c *putCmd) Help() string {
	return "Copies FILE into a new object NAME and seals it, so that readers can 'cudaipc get' it. " +
		"Files and sized input stream into the object without being held in memory; a pipe of unknown length is read first, up to 64 MiB (give --size for more). " +
		"A progress bar shows on a terminal. " +
		"A .safetensors file, or a directory of them (with its model.safetensors.index.json), is loaded as a bundle: " +
		"one object holding every tensor at a 256-byte-aligned offset, with its safetensors header as the manifest (--raw stores the bytes as they are)."
}

func (c *putCmd) Run(g *Globals) error {
	if !c.Raw && c.File != "-" && isSafetensors(c.File) {
		return c.putSafetensors(g)
	}
	if _, ok := protocol.DTypeSizes[c.DType]; c.DType != "" && !ok {
		return &ExitError{Code: 2, Err: fmt.Errorf("--dtype %q: not a dtype; one of %s", c.DType, strings.Join(slices.Sorted(maps.Keys(protocol.DTypeSizes)), ", "))}
	}
	want := int64(-1) // not given
	if c.Size > 0 {
		want = int64(c.Size)
	}
	in, err := openInput(c.File, want, g)
	if err != nil {
		return fmt.Errorf("put: %w", err)
	}
	defer in.Close()

	cl, err := g.dial()
	if err != nil {
		return err
	}
	defer cl.Close()

	ctx := g.Context()
	opts := client.CreateOptions{Device: c.Device, Shared: c.Shared, Versioned: c.Publish, Cluster: c.Cluster}
	if c.DType != "" {
		shape := c.Shape
		if shape == nil {
			item := protocol.DTypeSizes[c.DType]
			if in.size%item != 0 {
				return fmt.Errorf("--dtype %s: give --shape (the input's %d bytes are not a whole number of %s elements)", c.DType, in.size, c.DType)
			}
			shape = []int64{in.size / item}
		}
		opts.Tensor = &client.TensorDesc{DType: c.DType, Shape: shape, Strides: c.Strides}
	} else if c.Shape != nil || c.Strides != nil {
		return fmt.Errorf("--shape and --strides need --dtype")
	}
	// A stream given --size may still turn out longer: nothing may be
	// evicted for it before it is known to fit. Create without eviction;
	// if that needs room, read the stream to a temporary file first.
	opts.NoEvict = in.exact
	obj, err := cl.Create(ctx, c.Name, in.size, opts)
	if in.exact && errors.Is(err, client.ErrStoreFull) {
		if err := in.spool(); err != nil {
			return fmt.Errorf("reading %s: %w (nothing was stored or evicted)", c.File, err)
		}
		opts.NoEvict = false
		obj, err = cl.Create(ctx, c.Name, in.size, opts)
	}
	if err != nil {
		return explain(err, g.socketPath())
	}
	err = fill(obj, in.size, in.r, g, c.Name)
	if err == nil && in.exact {
		err = checkEnded(in.r, in.size)
	}
	if err != nil {
		_ = obj.Abort(ctx)
		return fmt.Errorf("reading %s: %w (nothing was stored)", c.File, err)
	}
	if err := obj.Seal(ctx); err != nil {
		return explain(err, g.socketPath())
	}
	fmt.Fprintf(g.stdout, "stored %q: %s (%d bytes) on %s\n", c.Name, bytesize.Format(in.size), in.size, obj.Device())
	return nil
}

// input is what put reads: size bytes from r.
type input struct {
	r     io.Reader
	size  int64
	exact bool // r must end after size bytes (a pipe given --size)
	close func() error
}

func (in *input) Close() error {
	if in.close == nil {
		return nil
	}
	return in.close()
}

// openInput opens FILE or standard input and decides the object's size
// (want, or -1 when --size is not given) without reading more than a
// bounded amount into memory: a regular file has its size; a pipe or
// device is streamed with --size, else read first, up to maxUnsizedInput.
func openInput(name string, want int64, g *Globals) (*input, error) {
	what := name
	if name == "-" {
		what = "standard input"
	}
	var f *os.File
	in := &input{}
	if name == "-" {
		f, _ = g.stdin.(*os.File) // never closed: it is our stdin
	} else {
		var err error
		if f, err = os.Open(name); err != nil {
			return nil, err
		}
		in.close = f.Close
	}
	var st os.FileInfo
	if f != nil {
		var err error
		if st, err = f.Stat(); err != nil {
			in.Close()
			return nil, err
		}
		in.r = f
	} else {
		in.r = g.stdin
	}
	switch {
	case st != nil && st.IsDir():
		in.Close()
		return nil, fmt.Errorf("%s is a directory: put stores one file", name)
	case st != nil && st.Mode().IsRegular():
		if want >= 0 && want != st.Size() {
			in.Close()
			return nil, &ExitError{Code: 2, Err: fmt.Errorf("--size %d, but %s has %d bytes", want, what, st.Size())}
		}
		if st.Size() == 0 {
			in.Close()
			return nil, fmt.Errorf("%s is empty: objects have at least 1 byte", what)
		}
		in.size = st.Size()
		return in, nil
	case want >= 0:
		// A device (/dev/urandom) yields as much as asked: store its first
		// bytes. A pipe must end there, or put would silently cut it.
		in.size = want
		in.exact = st == nil || st.Mode()&os.ModeCharDevice == 0
		return in, nil
	}
	// Fixed chunks rather than one growing buffer: the memory taken stays
	// close to what was read, with no copies while growing.
	var chunks []io.Reader
	var n int64
	for n <= maxUnsizedInput {
		buf := make([]byte, copyChunk)
		k, err := io.ReadFull(in.r, buf)
		n += int64(k)
		chunks = append(chunks, bytes.NewReader(buf[:k]))
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			break
		}
		if err != nil {
			in.Close()
			return nil, fmt.Errorf("reading %s: %w", what, err)
		}
	}
	in.Close()
	if n > maxUnsizedInput {
		return nil, fmt.Errorf("%s is longer than %s and its size is not known in advance: give --size to stream it (nothing was stored)", what, bytesize.Format(maxUnsizedInput))
	}
	if n == 0 {
		return nil, fmt.Errorf("%s is empty: objects have at least 1 byte", what)
	}
	return &input{r: io.MultiReader(chunks...), size: n}, nil
}

// spool reads a stream that must hold exactly in.size bytes into an
// unlinked temporary file and reads from that instead: the length is then
// known before anything is created for it.
func (in *input) spool() error {
	f, err := os.CreateTemp("", "cudaipc-put-*")
	if err != nil {
		return err
	}
	os.Remove(f.Name())
	n, err := io.Copy(f, io.LimitReader(in.r, in.size+1))
	switch {
	case err != nil:
	case n > in.size:
		err = fmt.Errorf("input is longer than --size %d", in.size)
	case n < in.size:
		err = fmt.Errorf("input ended after %d bytes, short of --size %d", n, in.size)
	}
	if err == nil {
		_, err = f.Seek(0, io.SeekStart)
	}
	if err != nil {
		f.Close()
		return err
	}
	prev := in.close
	in.r, in.exact = f, false
	in.close = func() error {
		err := f.Close()
		if prev != nil {
			err = errors.Join(err, prev())
		}
		return err
	}
	return nil
}

// checkEnded makes sure r has nothing after the size bytes already read.
func checkEnded(r io.Reader, size int64) error {
	var one [1]byte
	n, err := io.ReadFull(r, one[:])
	if n > 0 {
		return fmt.Errorf("input is longer than --size %d", size)
	}
	if errors.Is(err, io.EOF) {
		return nil
	}
	return err
}

// fill reads exactly size bytes from src into obj, showing progress on a
// terminal. Host objects are filled in place; GPU objects through a host
// buffer, one chunk at a time.
func fill(obj *client.Object, size int64, src io.Reader, g *Globals, name string) error {
	bar := newProgress(g.stderr, size, "put "+name)
	defer progressDone(bar)
	dst := obj.Bytes()
	var buf []byte
	if dst == nil {
		buf = make([]byte, min(int64(copyChunk), size))
	}
	for off := int64(0); off < size; {
		end := min(off+copyChunk, size)
		var chunk []byte
		if dst != nil {
			chunk = dst[off:end]
		} else {
			chunk = buf[:end-off]
		}
		n, err := io.ReadFull(src, chunk)
		progressAdd(bar, n)
		if err == io.ErrUnexpectedEOF || err == io.EOF {
			return fmt.Errorf("input ended after %d of %d bytes", off+int64(n), size)
		}
		if err != nil {
			return err
		}
		if dst == nil {
			if _, err := obj.WriteAt(chunk, off); err != nil {
				return err
			}
		}
		off = end
	}
	return nil
}
