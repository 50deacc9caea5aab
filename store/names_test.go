package store

import (
	"crypto/rand"
	"fmt"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// One name table: a name held by any kind (an object, a draft, a
// registration, a versioned name) is EXISTS for a create, register or
// seal-rename of every kind, and free again once deleted.
func TestNameTakenByAnyKindIsExists(t *testing.T) {
	_, path, _ := serveGPU(t, Config{})
	c := dialRaw(t, path)
	content := make([]byte, 32)
	rand.Read(content)
	register := func(name string) *storev1.Response {
		f := memfdPiece(t, content)
		defer f.Close()
		return c.register(&storev1.RegisterRequest{Name: name, Size: 1 << 20, Device: testGPU, Shared: true, Region: vmmRegion(t, 0, 1<<20, 2<<20), Files: 1}, f)
	}
	create := func(r *storev1.CreateRequest) *storev1.Response {
		resp, files := c.do(req(r))
		if code(resp) == storev1.Error_OK {
			c.mapping(resp.GetCreate().GetPlacement(), files) // keeps the arena the next creates reuse
		} else {
			protocol.CloseFiles(files)
		}
		return resp
	}
	const manifest = 64 // a create only needs the manifest's size
	creates := map[string]func(name string) *storev1.Response{
		"plain": func(n string) *storev1.Response { return create(&storev1.CreateRequest{Name: n, Size: 4096}) },
		"manifest": func(n string) *storev1.Response {
			return create(&storev1.CreateRequest{Name: n, Size: 4096, ManifestSize: manifest})
		},
		"versioned": func(n string) *storev1.Response {
			return create(&storev1.CreateRequest{Name: n, Size: 4096, Versioned: true})
		},
		"register": register,
		"rename": func(n string) *storev1.Response {
			draft := fmt.Sprintf(".draft-%s", n)
			wantCode(t, create(&storev1.CreateRequest{Name: draft, Size: 4096}), storev1.Error_OK)
			resp, _ := c.do(req(&storev1.SealRequest{Name: draft, Rename: n}))
			if code(resp) != storev1.Error_OK {
				r, _ := c.do(req(&storev1.AbortRequest{Name: draft}))
				wantCode(t, r, storev1.Error_OK)
			}
			return resp
		},
	}
	holders := map[string]func(name string) *storev1.Response{
		"registered": register,
		"draft":      creates["plain"],
		"sealed": func(n string) *storev1.Response {
			c.put(n, 4096, false)
			return &storev1.Response{}
		},
		"versioned": func(n string) *storev1.Response {
			resp := create(&storev1.CreateRequest{Name: n, Size: 4096, Versioned: true})
			if code(resp) == storev1.Error_OK {
				r, _ := c.do(req(&storev1.SealRequest{Name: n, Version: resp.GetCreate().GetVersion()}))
				wantCode(t, r, storev1.Error_OK)
			}
			return resp
		},
	}
	for holder, hold := range holders {
		for kind, take := range creates {
			if holder == "versioned" && kind == "versioned" {
				continue // the next version of the same name
			}
			name := "torch/" + holder + "-" + kind
			wantCode(t, hold(name), storev1.Error_OK)
			if resp := take(name); code(resp) != storev1.Error_EXISTS {
				t.Errorf("%s over a %s name: %v (%s), want EXISTS", kind, holder, code(resp), resp.GetError().GetMessage())
			}
			resp, _ := c.do(req(&storev1.DeleteRequest{Name: name}))
			wantCode(t, resp, storev1.Error_OK)
			// Freed: the same create now takes the name.
			if resp := take(name); code(resp) != storev1.Error_OK {
				t.Errorf("%s after the %s was deleted: %v (%s)", kind, holder, code(resp), resp.GetError().GetMessage())
			}
		}
	}
}

// The lease limit counts every kind of lease and the waiting gets alike.
func TestLeaseLimitCountsEveryKind(t *testing.T) {
	_, path, _ := serveGPU(t, Config{MaxLeasesPerClient: 2})
	c := dialRaw(t, path)
	f := memfdPiece(t, make([]byte, 32))
	defer f.Close()
	wantCode(t, c.register(&storev1.RegisterRequest{Name: "ext", Size: 1 << 20, Device: testGPU, Region: vmmRegion(t, 0, 1<<20, 2<<20), Files: 1}, f), storev1.Error_OK)
	c.put("obj", 4096, false)
	get := func(name string) *storev1.Response {
		resp, files := c.do(req(&storev1.GetRequest{Name: name}))
		protocol.CloseFiles(files)
		return resp
	}
	wantCode(t, get("ext"), storev1.Error_OK)
	wantCode(t, get("obj"), storev1.Error_OK)
	for _, name := range []string{"ext", "obj"} {
		if resp := get(name); code(resp) != storev1.Error_LIMIT {
			t.Errorf("a third lease (%s): %v, want LIMIT", name, code(resp))
		}
	}
}

// A name the daemon would show as something else is refused, one line,
// INVALID, by every request that takes a name: " 65534:x" and "065534:x"
// were plain names of their creator, listed to others as "0: 65534:x".
// A canonical qualified name still reaches another uid's object.
func TestNonCanonicalUIDPrefixIsInvalid(t *testing.T) {
	_, path, _ := serve(t, Config{})
	c := dialRaw(t, path)
	for _, name := range []string{" 65534:x", "065534:x", "65534 :x", "x ", "0:065534:x"} {
		for _, r := range []*storev1.Request{
			req(&storev1.CreateRequest{Name: name, Size: 4096}),
			req(&storev1.GetRequest{Name: name}),
			req(&storev1.StatRequest{Name: name}),
			req(&storev1.DeleteRequest{Name: name}),
		} {
			resp, files := c.do(r)
			protocol.CloseFiles(files)
			wantCode(t, resp, storev1.Error_INVALID)
			if msg := resp.GetError().GetMessage(); strings.Contains(msg, "\n") || !strings.Contains(msg, "object name") {
				t.Errorf("%T of %q: %q", r.GetBody(), name, msg)
			}
		}
	}
	c.put("x", 4096, false)
	resp, _ := c.do(req(&storev1.StatRequest{Name: "0:x"}))
	wantCode(t, resp, storev1.Error_OK)
	resp, _ = c.do(req(&storev1.ListRequest{}))
	for _, o := range resp.GetList().GetObjects() {
		if o.GetName() != "x" {
			t.Errorf("listed %q", o.GetName())
		}
	}
}
