package protocol

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/protocol/storev1"
	"google.golang.org/protobuf/proto"
)

func TestValidateName(t *testing.T) {
	good := []string{"a", "tensor-0", "model/layer.0", "weights.layer 3", "ünïcödé", "日本語", strings.Repeat("x", MaxNameLen), "\uFFFD", "a:b@c=d"}
	bad := []string{"", strings.Repeat("x", MaxNameLen+1), "nul\x00", "tab\t", "nl\n", "del\x7f",
		"c1\u0085", "\xff", "bidi\u202e", "zero\u200bwidth", "nbsp\u00a0"}
	for _, n := range good {
		if err := ValidateName(n); err != nil {
			t.Errorf("ValidateName(%q) = %v, want nil", n, err)
		}
	}
	for _, n := range bad {
		err := ValidateName(n)
		if !errors.Is(err, ErrInvalid) || CodeOf(err) != storev1.Error_INVALID {
			t.Errorf("ValidateName(%q) = %v, want an INVALID error", n, err)
		}
	}
}

// TestValidateNameUIDPrefix: a name that starts with a uid prefix has it in
// canonical decimal (no leading zeros, no spaces, a uint32), and no name,
// or the part of a qualified one after its uid, starts or ends with a
// space: otherwise " 65534:x" or "065534:x" would be plain names of the
// caller, shown to others as "0: 65534:x".
func TestValidateNameUIDPrefix(t *testing.T) {
	good := []string{"0:x", "65534:x", "65534:model/w", "4294967295:x", "a b", "2024-01:ckpt", "x:007", "v1.0:x", "1a:x", "65534:1:x"}
	for _, n := range good {
		if err := ValidateName(n); err != nil {
			t.Errorf("ValidateName(%q) = %v, want nil", n, err)
		}
	}
	for n, want := range map[string]string{
		" 65534:x":       "starts or ends with a space",
		"065534:x":       "canonical decimal",
		"00:x":           "canonical decimal",
		"65534 :x":       "canonical decimal",
		"655 34:x":       "canonical decimal",
		"4294967296:x":   "canonical decimal",
		"12345678901:x":  "canonical decimal",
		"65534:065534:x": "canonical decimal",
		"65534: x":       "starts or ends with a space",
		"x ":             "starts or ends with a space",
		" x":             "starts or ends with a space",
		"65534:x ":       "starts or ends with a space",
		" ":              "starts or ends with a space",
	} {
		err := ValidateName(n)
		if !errors.Is(err, ErrInvalid) || CodeOf(err) != storev1.Error_INVALID || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("ValidateName(%q) = %v, want INVALID saying %q", n, err, want)
		}
	}
}

func TestValidateSizeAndDevice(t *testing.T) {
	for _, s := range []uint64{1, 4096, MaxObjectSize} {
		if err := ValidateSize(s); err != nil {
			t.Errorf("ValidateSize(%d) = %v", s, err)
		}
	}
	for _, s := range []uint64{0, MaxObjectSize + 1, 1 << 63} {
		if err := ValidateSize(s); !errors.Is(err, ErrInvalid) {
			t.Errorf("ValidateSize(%d) = %v, want ErrInvalid", s, err)
		}
	}
	for _, d := range []string{"", "host", "0", "GPU-8f3a9c2e-1b2d-4c5e-9f00-123456789abc"} {
		if err := ValidateDevice(d); err != nil {
			t.Errorf("ValidateDevice(%q) = %v", d, err)
		}
	}
	for _, d := range []string{"ho st", "gpu\x00", "é", strings.Repeat("d", MaxDeviceLen+1)} {
		if err := ValidateDevice(d); !errors.Is(err, ErrInvalid) {
			t.Errorf("ValidateDevice(%q) = %v, want ErrInvalid", d, err)
		}
	}
}

func TestValidateRequest(t *testing.T) {
	req := func(id uint64, body proto.Message) *storev1.Request {
		r := testutil.Request(body)
		r.Id = id
		return r
	}
	good := []*storev1.Request{
		req(1, &storev1.HelloRequest{Version: 1, ClientName: "trainer"}),
		req(1, &storev1.HelloRequest{Version: 99}), // version checked separately
		req(2, &storev1.CreateRequest{Name: "x", Size: 1}),
		req(2, &storev1.CreateRequest{Name: "x", Size: MaxObjectSize, Device: "host", Shared: true}),
		req(3, &storev1.SealRequest{Name: "x"}),
		req(3, &storev1.SealRequest{Name: ".ahead", Rename: "x", Tensor: &storev1.TensorDesc{Dtype: "uint8", Shape: []int64{1}}}),
		req(4, &storev1.AbortRequest{Name: "x"}),
		req(5, &storev1.GetRequest{Name: "x", TimeoutMs: -1}),
		req(5, &storev1.GetRequest{Name: "x", Tensors: []string{"b", "a", "layer 0/w\u00e9"}}),
		req(6, &storev1.ReleaseRequest{LeaseId: 1}),
		req(7, &storev1.DeleteRequest{Name: "x"}),
		req(8, &storev1.ListRequest{}),
		req(8, &storev1.ListRequest{StartAfter: "x"}),
		req(9, &storev1.StatRequest{Name: "x"}),
		req(10, &storev1.SubscribeRequest{}),
	}
	for _, r := range good {
		if err := ValidateRequest(r, 0); err != nil {
			t.Errorf("ValidateRequest(%v) = %v", r, err)
		}
		if k := RequestKind(r); k == "unknown" {
			t.Errorf("RequestKind(%v) = unknown", r)
		}
	}
	bad := map[string]*storev1.Request{
		"id 0":            req(0, &storev1.SealRequest{Name: "x"}),
		"no body":         {Id: 1},
		"hello v0":        req(1, &storev1.HelloRequest{}),
		"hello ctl":       req(1, &storev1.HelloRequest{Version: 1, ClientName: "a\nb"}),
		"create size 0":   req(1, &storev1.CreateRequest{Name: "x"}),
		"create huge":     req(1, &storev1.CreateRequest{Name: "x", Size: MaxObjectSize + 1}),
		"create noname":   req(1, &storev1.CreateRequest{Size: 1}),
		"create device":   req(1, &storev1.CreateRequest{Name: "x", Size: 1, Device: "a b"}),
		"seal tab":        req(1, &storev1.SealRequest{Name: "a\tb"}),
		"seal rename":     req(1, &storev1.SealRequest{Name: "a", Rename: "b\nc"}),
		"seal rename v":   req(1, &storev1.SealRequest{Name: "a", Rename: "b", Version: 2}),
		"abort empty":     req(1, &storev1.AbortRequest{}),
		"get empty":       req(1, &storev1.GetRequest{}),
		"get tensor \"\"": req(1, &storev1.GetRequest{Name: "x", Tensors: []string{"a", ""}}),
		"get tensor 2x":   req(1, &storev1.GetRequest{Name: "x", Tensors: []string{"a", "b", "a"}}),
		"release 0":       req(1, &storev1.ReleaseRequest{}),
		"delete ctl":      req(1, &storev1.DeleteRequest{Name: "\x01"}),
		"list bad":        req(1, &storev1.ListRequest{StartAfter: "a\nb"}),
		"stat empty":      req(1, &storev1.StatRequest{}),
	}
	for name, r := range bad {
		if err := ValidateRequest(r, 0); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: ValidateRequest = %v, want ErrInvalid", name, err)
		}
	}
	if err := ValidateRequest(bad["get tensor 2x"], 0); err == nil || !strings.Contains(err.Error(), `tensor "a" is named twice`) {
		t.Errorf("a tensor named twice: %v", err)
	}
	if err := ValidateRequest(good[2], 1); !errors.Is(err, ErrInvalid) {
		t.Errorf("request with a file: %v, want ErrInvalid", err)
	}
	if err := ValidateRequest(nil, 0); !errors.Is(err, ErrInvalid) {
		t.Errorf("nil request: %v, want ErrInvalid", err)
	}
	// An operation from a newer client decodes as an unknown field.
	newer := append(mustMarshal(t, &storev1.Request{Id: 4}), 0xfa, 0x01, 0x00) // field 31, empty message
	var r storev1.Request
	if err := proto.Unmarshal(newer, &r); err != nil {
		t.Fatal(err)
	}
	if err := ValidateRequest(&r, 0); !errors.Is(err, ErrInvalid) || RequestKind(&r) != "unknown" {
		t.Errorf("unknown operation: %v, %s; want ErrInvalid, unknown", err, RequestKind(&r))
	}
}

func TestCheckVersion(t *testing.T) {
	if err := CheckVersion(Version); err != nil {
		t.Fatal(err)
	}
	for _, v := range []uint32{0, Version + 1} {
		if err := CheckVersion(v); !errors.Is(err, ErrVersion) || CodeOf(err) != storev1.Error_VERSION {
			t.Errorf("CheckVersion(%d) = %v, want ErrVersion", v, err)
		}
	}
}

func placement(writable, attached bool) *storev1.Placement {
	return &storev1.Placement{Kind: storev1.Placement_HOST, ArenaId: 1, Device: "host", Offset: 256, Size: 100, ArenaSize: 1 << 20,
		Writable: writable, FdAttached: attached}
}

func info(name string) *storev1.ObjectInfo {
	return &storev1.ObjectInfo{Name: name, Size: 100, Device: "host", Sealed: true, OwnerUid: 1000}
}

func TestValidateResponse(t *testing.T) {
	type tc struct {
		r      *storev1.Response
		nfiles int
	}
	get := func(p *storev1.Placement, i *storev1.ObjectInfo) *storev1.Response {
		return &storev1.Response{Id: 5, Body: &storev1.Response_Get{Get: &storev1.GetResponse{LeaseId: 3, Placement: p, Info: i}}}
	}
	create := func(p *storev1.Placement) *storev1.Response {
		return &storev1.Response{Id: 5, Body: &storev1.Response_Create{Create: &storev1.CreateResponse{Placement: p}}}
	}
	gpu := func(kind storev1.Placement_Kind, attached bool, region []byte) *storev1.Placement {
		p := placement(false, attached)
		p.Kind, p.Device, p.Region = kind, "GPU-12345678-1234-1234-1234-123456789abc", region
		return p
	}
	gpuInfo := info("x")
	gpuInfo.Device = "GPU-12345678-1234-1234-1234-123456789abc"
	noKind := placement(false, false)
	noKind.Kind = storev1.Placement_KIND_UNSPECIFIED
	hostRegion := placement(false, false)
	hostRegion.Region = []byte{1}
	good := []tc{
		{&storev1.Response{Id: 1, Body: &storev1.Response_Hello{Hello: &storev1.HelloResponse{Version: 1}}}, 0},
		{get(gpu(storev1.Placement_CUDA_IPC, false, []byte{1}), gpuInfo), 0},
		{get(gpu(storev1.Placement_VMM_FD, true, []byte{1}), gpuInfo), 1},
		{create(placement(true, true)), 1},
		{create(placement(true, false)), 0},
		{get(placement(false, true), info("x")), 1},
		{get(placement(false, false), info("x")), 0},
		{&storev1.Response{Id: 2, Body: &storev1.Response_List{List: &storev1.ListResponse{Objects: []*storev1.ObjectInfo{info("a"), info("b")}}}}, 0},
		{&storev1.Response{Id: 2, Body: &storev1.Response_Stat{Stat: &storev1.StatResponse{Info: info("a")}}}, 0},
		{&storev1.Response{Id: 2, Body: &storev1.Response_Seal{Seal: &storev1.SealResponse{}}}, 0},
		{NewEvent(storev1.Event_SEALED, "x"), 0},
		{NewEvent(storev1.Event_Kind(42), "x"), 0}, // a kind from a newer server
		{ErrorResponse(9, Errorf(storev1.Error_NOT_FOUND, "no x")), 0},
		{&storev1.Response{Id: 9, Error: &storev1.Error{Code: 77}}, 0},           // a code from a newer server
		{ErrorResponse(0, Errorf(storev1.Error_INVALID, "malformed packet")), 0}, // connection-level error
	}
	for i, c := range good {
		if err := ValidateResponse(c.r, c.nfiles); err != nil {
			t.Errorf("good %d: ValidateResponse(%v, %d) = %v", i, c.r, c.nfiles, err)
		}
	}
	tooBig := placement(false, false)
	tooBig.Offset = tooBig.ArenaSize - 99
	wrap := placement(false, false)
	wrap.Offset, wrap.Size, wrap.ArenaSize = 1<<63, 1<<40, 1<<40
	wrongSize := info("x")
	wrongSize.Size = 7
	bad := map[string]tc{
		"nil":               {nil, 0},
		"no body":           {&storev1.Response{Id: 1}, 0},
		"event id":          {&storev1.Response{Id: 3, Body: &storev1.Response_Event{Event: &storev1.Event{Kind: 1, Name: "x"}}}, 0},
		"id 0 not event":    {&storev1.Response{Body: &storev1.Response_Seal{Seal: &storev1.SealResponse{}}}, 0},
		"error with body":   {&storev1.Response{Id: 1, Error: &storev1.Error{Code: 2}, Body: &storev1.Response_Seal{Seal: &storev1.SealResponse{}}}, 0},
		"error with file":   {ErrorResponse(1, ErrNotFound), 1},
		"file not attached": {create(placement(true, false)), 1},
		"attached no file":  {create(placement(true, true)), 0},
		"two files":         {create(placement(true, true)), 2},
		"create read-only":  {create(placement(false, false)), 0},
		"get writable":      {get(placement(true, false), info("x")), 0},
		"no placement":      {create(nil), 0},
		"past arena":        {get(tooBig, info("x")), 0},
		"overflow":          {get(wrap, info("x")), 0},
		"no info":           {get(placement(false, false), nil), 0},
		"sizes differ":      {get(placement(false, false), wrongSize), 0},
		"lease 0":           {&storev1.Response{Id: 1, Body: &storev1.Response_Get{Get: &storev1.GetResponse{Placement: placement(false, false), Info: info("x")}}}, 0},
		"hello v0":          {&storev1.Response{Id: 1, Body: &storev1.Response_Hello{Hello: &storev1.HelloResponse{}}}, 0},
		"list bad name":     {&storev1.Response{Id: 1, Body: &storev1.Response_List{List: &storev1.ListResponse{Objects: []*storev1.ObjectInfo{info("a\x00b")}}}}, 0},
		"stat no info":      {&storev1.Response{Id: 1, Body: &storev1.Response_Stat{Stat: &storev1.StatResponse{}}}, 0},
		"event bad name":    {NewEvent(storev1.Event_DELETED, ""), 0},
		"ok with a file":    {&storev1.Response{Id: 2, Body: &storev1.Response_Seal{Seal: &storev1.SealResponse{}}}, 1},
		"too many files":    {create(placement(true, true)), MaxFiles + 1},
		"no kind":           {get(noKind, info("x")), 0},
		"unknown kind":      {get(gpu(7, false, []byte{1}), gpuInfo), 0},
		"host with region":  {get(hostRegion, info("x")), 0},
		"host kind on GPU":  {get(gpu(storev1.Placement_HOST, false, nil), gpuInfo), 0},
		"GPU no region":     {get(gpu(storev1.Placement_CUDA_IPC, false, nil), gpuInfo), 0},
		"ipc with fd":       {get(gpu(storev1.Placement_CUDA_IPC, true, []byte{1}), gpuInfo), 1},
		"vmm-fd without fd": {get(gpu(storev1.Placement_VMM_FD, false, []byte{1}), gpuInfo), 0},
	}
	for name, c := range bad {
		err := ValidateResponse(c.r, c.nfiles)
		var me *MessageError
		if !errors.Is(err, ErrMalformed) || !errors.As(err, &me) {
			t.Errorf("%s: ValidateResponse = %v, want a *MessageError matching ErrMalformed", name, err)
		}
	}
}

func TestErrorCodesRoundTrip(t *testing.T) {
	// Every code of the schema but OK, new ones included, has a sentinel
	// that CodeOf tries.
	if len(codeOrder) != len(storev1.Error_Code_name)-1 {
		t.Fatalf("CodeOf tries %d codes, the schema has %d besides OK", len(codeOrder), len(storev1.Error_Code_name)-1)
	}
	for n := range storev1.Error_Code_name {
		c := storev1.Error_Code(n)
		if c == storev1.Error_OK {
			continue
		}
		sentinel := codeSentinels[c]
		if sentinel == nil {
			t.Fatalf("no sentinel for %v", c)
		}
		// Server side: a wrapped sentinel becomes a response with that code.
		resp := ErrorResponse(11, fmt.Errorf("seal %q: %w", "obj", sentinel))
		if resp.GetError().GetCode() != c || resp.GetId() != 11 || resp.GetError().GetMessage() != `seal "obj"` {
			t.Errorf("ErrorResponse for %v = %v", c, resp)
		}
		// Across the wire and back: the client sees the same sentinel.
		var back storev1.Response
		if err := proto.Unmarshal(mustMarshal(t, resp), &back); err != nil {
			t.Fatal(err)
		}
		err := ResponseError(&back)
		if !errors.Is(err, sentinel) || CodeOf(err) != c {
			t.Errorf("ResponseError for %v = %v", c, err)
		}
		var ce *CodeError
		if !errors.As(err, &ce) || ce.Code != c {
			t.Errorf("ResponseError for %v is not a *CodeError with that code: %v", c, err)
		}
		if !strings.Contains(err.Error(), sentinel.Error()) {
			t.Errorf("message %q does not name the error %q", err, sentinel)
		}
	}
	// The code's name appears once in the client's error text.
	for _, c := range []struct {
		err  error
		want string
	}{
		{ErrNotFound, "not found"},
		{fmt.Errorf("seal %q: %w", "x", ErrNotFound), `not found: seal "x"`},
		{Errorf(storev1.Error_EXISTS, "object %q", "x"), `already exists: object "x"`},
		{fmt.Errorf("create: %w", Errorf(storev1.Error_STORE_FULL, "need 4096 bytes")), "store full: create: need 4096 bytes"},
		{fmt.Errorf("create: %w", &CodeError{Code: storev1.Error_LIMIT}), "limit reached: create"},
		{errors.New("disk on fire"), "internal error: disk on fire"},
		{fmt.Errorf("get: %w", Errorf(storev1.Error_UNAVAILABLE, "etcd did not answer")), "unavailable: get: etcd did not answer"},
		{fmt.Errorf("get chunk 3: %w", ErrDataLoss), "data does not verify: get chunk 3"},
	} {
		got := ResponseError(ErrorResponse(1, c.err))
		if got.Error() != c.want {
			t.Errorf("error %q arrives as %q, want %q", c.err, got, c.want)
		}
	}
	if CodeOf(nil) != storev1.Error_OK {
		t.Error("CodeOf(nil) != OK")
	}
	if CodeOf(io.ErrUnexpectedEOF) != storev1.Error_INTERNAL {
		t.Error("unknown errors must map to INTERNAL")
	}
	if r := ErrorResponse(1, nil); r.GetError().GetCode() != storev1.Error_INTERNAL {
		t.Errorf("ErrorResponse(nil) = %v, want INTERNAL", r)
	}
	if ResponseError(&storev1.Response{Id: 1}) != nil || ResponseError(&storev1.Response{Id: 1, Error: &storev1.Error{}}) != nil {
		t.Error("a response without an error code must report nil")
	}
	unknown := ResponseError(&storev1.Response{Id: 1, Error: &storev1.Error{Code: 99, Message: "new"}})
	if unknown == nil || CodeOf(unknown) != 99 || errors.Is(unknown, ErrInternal) {
		t.Errorf("unknown code: %v", unknown)
	}
}

func TestListPage(t *testing.T) {
	// Many objects with the longest names and some region bytes.
	var objs []*storev1.ObjectInfo
	for i := range 3000 {
		o := info(fmt.Sprintf("%05d-%s", i, strings.Repeat("é", (MaxNameLen-6)/2)))
		o.Region = randomBytes(t, 64)
		o.CreatedUnixNano = -1
		o.Leases, o.OwnerUid, o.Size = ^uint32(0), ^uint32(0), MaxObjectSize
		objs = append(objs, o)
	}
	client, server := connPair(t)
	var got []*storev1.ObjectInfo
	rest := objs
	for pages := 0; ; pages++ {
		if pages > len(objs) {
			t.Fatal("no progress")
		}
		resp := ListPage(^uint64(0), rest)
		if err := server.Send(resp); err != nil {
			t.Fatalf("page %d: %v", pages, err)
		}
		var back storev1.Response
		if _, err := client.Recv(&back); err != nil {
			t.Fatal(err)
		}
		page := back.GetList()
		if len(page.GetObjects()) == 0 {
			t.Fatal("empty page")
		}
		got = append(got, page.GetObjects()...)
		rest = rest[len(page.GetObjects()):]
		if !page.GetMore() {
			break
		}
		// Pages should be reasonably full.
		if n := proto.Size(&back); n < MaxMessageSize-1024 {
			t.Errorf("page %d has only %d bytes", pages, n)
		}
	}
	if len(got) != len(objs) || len(rest) != 0 {
		t.Fatalf("got %d objects, want %d", len(got), len(objs))
	}
	for i := range objs {
		if !proto.Equal(got[i], objs[i]) {
			t.Fatalf("object %d differs", i)
		}
	}
	if r := ListPage(1, nil); r.GetList().GetMore() || len(r.GetList().GetObjects()) != 0 || ValidateResponse(r, 0) != nil {
		t.Errorf("empty list page: %v", r)
	}
}

// classError is a sentinel of another package that wraps a protocol
// sentinel to say which code it travels as (package cluster's do).
type classError struct {
	msg   string
	class error
}

func (e *classError) Error() string { return e.msg }
func (e *classError) Unwrap() error { return e.class }

// TestClusterClassesMapToCodes: a foreign sentinel wrapping ErrUnavailable
// or ErrDataLoss travels with that code, keeps its own text once, and wins
// over a NOT_FOUND the same error also wraps (a pull whose holders were
// unreachable may also carry a holder's "not found").
func TestClusterClassesMapToCodes(t *testing.T) {
	unavailable := &classError{"cluster directory unavailable", ErrUnavailable}
	badRecord := &classError{"malformed or unauthenticated cluster record", ErrDataLoss}
	for _, c := range []struct {
		err  error
		code storev1.Error_Code
		want string
	}{
		{fmt.Errorf("%w: etcd at x did not answer", unavailable), storev1.Error_UNAVAILABLE, "unavailable: cluster directory unavailable: etcd at x did not answer"},
		{fmt.Errorf("look up 1000:w: %w", badRecord), storev1.Error_DATA_LOSS, "data does not verify: look up 1000:w: malformed or unauthenticated cluster record"},
		{fmt.Errorf("pull: %w (node b: %w)", unavailable, ErrNotFound), storev1.Error_UNAVAILABLE, "unavailable: pull: cluster directory unavailable (node b: not found)"},
		{fmt.Errorf("pull: %w (node b: %w)", ErrNotFound, badRecord), storev1.Error_DATA_LOSS, "data does not verify: pull: not found (node b: malformed or unauthenticated cluster record)"},
	} {
		if got := CodeOf(c.err); got != c.code {
			t.Errorf("CodeOf(%q) = %v, want %v", c.err, got, c.code)
		}
		var back storev1.Response
		if err := proto.Unmarshal(mustMarshal(t, ErrorResponse(3, c.err)), &back); err != nil {
			t.Fatal(err)
		}
		got := ResponseError(&back)
		if !errors.Is(got, Sentinel(c.code)) || got.Error() != c.want {
			t.Errorf("%q arrives as %q (code %v), want %q", c.err, got, CodeOf(got), c.want)
		}
	}
}
