#!/usr/bin/env python3
"""Build the rfcs-long BEIR-style retrieval eval set.

Reads RFC 2616, 3986 and 6749 from /work/shared/data/corpus/rfcs/, splits each at
top-level and second-level section headings, merges consecutive small sections
into passages of >= MIN_CHARS characters, and writes corpus.jsonl, queries.jsonl,
qrels/test.tsv and answers.jsonl next to this script.  Then verifies the set.
"""
import json
import os
import re
import sys

SRC = "/work/shared/data/corpus/rfcs"
OUT = os.path.dirname(os.path.abspath(__file__))
RFCS = ["2616", "3986", "6749"]
MIN_CHARS = 2500

# Numbered headings at column 0: "3.2.1 URI Comparison", "4.1.2.  Authorization Response",
# plus appendix headings "Appendix A.  Collected ABNF" and "A.1.  ..." / "D.2.  ...".
HEAD_RE = re.compile(r"^(?:Appendix\s+)?((?:\d+|[A-Z])(?:\.\d+)*)\.?\s+(\S.*)$")
FOOTER_RE = re.compile(r"^\S.*\[Page \d+\]\s*$")
HEADER_RE = re.compile(r"^RFC \d+\s{2,}.*\S\s*$")

# Back matter that is dropped (boilerplate, not content); matched on section title.
DROP_TITLES = re.compile(
    r"^(Acknowledge?ments|(Normative |Informative )?References|Authors?' Addresses|Index|Full Copyright Statement)$",
    re.I)


# The shared copy of RFC 6749 carries third-party Chinese reading glosses that are
# not part of the RFC, e.g. "authentication(n. \u6388\u6743) model", a pure-Chinese line and
# note lines starting with "\u6ce8:".  They are stripped so passages hold RFC text only.
CJK = "\u3000-\u303f\u4e00-\u9fff\uff00-\uffef"
GLOSS_RE = re.compile(r"\((?:[^()]|\([^()]*\))*[" + CJK + r"](?:[^()]|\([^()]*\))*\)")
NOTE_LINE_RE = re.compile(r"^\s*(?:\u6ce8\s*[:\uff1a]|[" + CJK + r"])")


def strip_gloss(line):
    if NOTE_LINE_RE.match(line):
        return None
    # "(%x20, <gloss>)" -> "(%x20)": keep the RFC's own parenthetical
    line = re.sub(r"\((%x[0-9A-Fa-f]+),\s*[^()]*?[" + CJK + r"][^()]*\)", r"(\1)", line)
    return GLOSS_RE.sub("", line)


def clean_lines(raw):
    """Remove page footers/headers and form feeds; join pages with a single newline."""
    lines = [l for l in (strip_gloss(x) for x in raw.split("\n")) if l is not None]
    out = []
    i = 0
    while i < len(lines):
        ln = lines[i].rstrip()
        if FOOTER_RE.match(ln):
            # drop blank padding before the footer
            while out and out[-1] == "":
                out.pop()
            i += 1
            # skip form feed, running header and blank lines after it
            while i < len(lines) and (lines[i].strip() in ("", "\f") or
                                      HEADER_RE.match(lines[i].replace("\f", ""))):
                i += 1
            continue
        out.append(ln.replace("\f", ""))
        i += 1
    return out


def sections(rfc):
    raw = open(os.path.join(SRC, f"rfc{rfc}.txt"), encoding="utf-8").read()
    lines = clean_lines(raw)
    # body starts at the first "1 Introduction"/"1.  Introduction" heading at column 0
    start = next(i for i, l in enumerate(lines)
                 if re.match(r"^1\.?\s+Introduction\s*$", l))
    secs = []  # (number, title, [lines])
    cur = None
    body = lines[start:]
    for k, ln in enumerate(body):
        m = HEAD_RE.match(ln) if ln and not ln[0].isspace() else None
        if m and len(ln) > 60 and k + 1 < len(body) and \
                re.match(r"^\s{5,}\S.{0,38}$", body[k + 1]):
            # heading title wrapped onto a second line ("... in Implicit" / "Flow")
            m = HEAD_RE.match(ln + " " + body[k + 1].strip())
        if ln and not ln[0].isspace() and not m:
            # unnumbered column-0 heading (Index, Authors' Addresses, copyright ...)
            cur = ("-", ln.strip(), [ln])
            secs.append(cur)
            continue
        if m:
            num, title = m.group(1), m.group(2).strip()
            depth = num.count(".") + 1
            if depth <= 2:
                cur = (num, title, [ln])
                secs.append(cur)
                continue
        if cur is not None:
            cur[2].append(ln)
    kept = []
    dropped_top = None
    for num, title, ls in secs:
        top = num.split(".")[0]
        if num == "-" or DROP_TITLES.match(title):
            if "." not in num:
                dropped_top = top
            continue
        if dropped_top is not None and top == dropped_top and "." in num:
            continue  # subsection of a dropped back-matter section (10.1 Normative References)
        text = "\n".join(ls).strip("\n")
        text = re.sub(r"\n{3,}", "\n\n", text)
        kept.append((num, title, text))
    return kept


def passages(rfc):
    secs = sections(rfc)
    groups = []
    cur = []
    for s in secs:
        cur.append(s)
        if len("\n\n".join(x[2] for x in cur)) >= MIN_CHARS:
            groups.append(cur)
            cur = []
    if cur:
        if groups:
            groups[-1].extend(cur)
        else:
            groups.append(cur)
    out = []
    sec2doc = {}
    for g in groups:
        pid = f"rfc{rfc}__{g[0][0]}"
        text = "\n\n".join(x[2] for x in g)
        out.append({"_id": pid, "title": f"RFC {rfc} \u2014 {g[0][1]}", "text": text,
                    "sections": [x[0] for x in g]})
        for x in g:
            sec2doc[x[0]] = pid
    return out, sec2doc


def build_corpus():
    docs, sec2doc = [], {}
    for rfc in RFCS:
        d, m = passages(rfc)
        docs.extend(d)
        for k, v in m.items():
            sec2doc[(rfc, k)] = v
    return docs, sec2doc


def doc_for(sec2doc, rfc, sec):
    """Map a (possibly third-level) section number to the passage holding it."""
    parts = sec.split(".")
    while parts:
        key = (rfc, ".".join(parts))
        if key in sec2doc:
            return sec2doc[key]
        parts.pop()
    raise KeyError((rfc, sec))


# ---------------------------------------------------------------------------
# Questions (written by an AI assistant).  Each answerable entry:
#   (question, rfc, [gold section numbers, 1-2], [answer strings copied verbatim
#    from the primary gold passage]).
# Section numbers are mapped to the passage that contains them, so the labels
# survive changes to the merge threshold.
# ---------------------------------------------------------------------------
ANSWERABLE = [
    # ---- RFC 2616 (HTTP/1.1) ----
    ("which status code does a server send when none of the byte ranges the client asked for overlap the resource",
     "2616", ["10.4.17"], ["416"]),
    ("does an HTTP/1.1 client have to send a Host header on every request",
     "2616", ["14.23"], ["MUST include a Host header field"]),
    ("how does the receiver know that a chunked response body has ended",
     "2616", ["3.6"], ["zero, followed by the trailer"]),
    ("which date format must HTTP/1.1 senders generate in header values",
     "2616", ["3.3"], ["RFC 1123 format"]),
    ("if a text/* response has no charset parameter which character set should the client assume",
     "2616", ["3.7"], ["ISO-8859-1"]),
    ("are HTTP header field names matched case sensitively",
     "2616", ["4.2"], ["case-insensitive"]),
    ("a message carries both Transfer-Encoding and Content-Length, which one does the recipient use",
     "2616", ["4.4"], ["the latter MUST be ignored"]),
    ("are GET and HEAD allowed to have effects other than retrieving data",
     "2616", ["9.1"], ["SHOULD NOT have the significance"]),
    ("which request methods are idempotent in HTTP/1.1",
     "2616", ["9.1"], ["PUT and DELETE share this property"]),
    ("how does the server response to HEAD differ from the response to GET",
     "2616", ["9.4"], ["return a message-body in the response"]),
    ("what content type does the body of a TRACE response use",
     "2616", ["9.8"], ["\"message/http\""]),
    ("after a 201 Created how does the server tell the client the URI of the new resource",
     "2616", ["10.2.2"], ["Location header field"]),
    ("what does a 202 response promise about whether the request was actually carried out",
     "2616", ["10.2.3"], ["accepted for processing"]),
    ("can the browser automatically resend a POST to the new URL after a 301 redirect",
     "2616", ["10.3.2"], ["MUST NOT automatically redirect"]),
    ("is a 307 Temporary Redirect response cacheable by default",
     "2616", ["10.3.8"], ["only cacheable if indicated"]),
    ("which response header has to accompany a 401 Unauthorized status",
     "2616", ["10.4.2"], ["WWW-Authenticate header field"]),
    ("what status should a server return when it refuses a request because no Content-Length was given",
     "2616", ["10.4.12"], ["411"]),
    ("how can a 503 Service Unavailable response tell the client when to try again",
     "2616", ["10.5.4"], ["Retry-After"]),
    ("are HTTP/1.1 connections kept open between requests unless someone says otherwise",
     "2616", ["8.1"], ["persistent connections are the default"]),
    ("how many simultaneous connections should a single-user browser keep open to one server",
     "2616", ["8.1"], ["more than 2 connections"]),
    ("is it okay to pipeline POST requests on a persistent connection",
     "2616", ["8.1"], ["non-idempotent methods"]),
    ("what Expect value lets a client check that the server will accept a large request body before sending it",
     "2616", ["8.2"], ["100-continue"]),
    ("when must a cache add warning 113 to a response whose freshness was computed heuristically",
     "2616", ["13.2"], ["more than 24 hours"]),
    ("how is the apparent age of a cached response calculated",
     "2616", ["13.2"], ["max(0, response_time - date_value)"]),
    ("what prefix marks an entity tag as weak",
     "2616", ["3.11"], ["\"W/\""]),
    ("which comparison function must be used on validators for sub-range retrievals",
     "2616", ["13.3"], ["strong comparison function"]),
    ("what is the no-store cache directive meant to prevent",
     "2616", ["14.9"], ["retention of sensitive information"]),
    ("if a response has both max-age and an Expires header which one wins",
     "2616", ["14.9"], ["overrides the Expires header"]),
    ("what should a cache return if a must-revalidate entry cannot be revalidated because the origin is unreachable",
     "2616", ["14.9"], ["504 (Gateway Timeout)"]),
    ("how should a client treat an Expires header whose value is 0",
     "2616", ["14.21"], ["already expired"]),
    ("what weight does a media range in the Accept header get when q is omitted",
     "2616", ["14.1"], ["q=1"]),
    ("how do I ask for just the last 500 bytes of a file with the Range header",
     "2616", ["14.35"], ["bytes=-500"]),
    ("how can a server advertise that it does not support byte range requests",
     "2616", ["14.5"], ["Accept-Ranges: none"]),
    ("what should a server send for a conditional GET when an If-None-Match ETag matches",
     "2616", ["14.26"], ["304 (Not Modified)"]),
    ("which status is returned when an If-Match precondition fails",
     "2616", ["14.24"], ["412 (Precondition Failed)"]),
    ("what does the server send for an If-Range request when the entity tag no longer matches",
     "2616", ["14.27"], ["entire entity using a 200 (OK) response"]),
    ("what must a proxy do with a TRACE or OPTIONS request whose Max-Forwards value is zero",
     "2616", ["14.31"], ["MUST NOT forward the request"]),
    ("which status code does a server use when it agrees to an Upgrade to a different protocol",
     "2616", ["14.42"], ["101 (Switching Protocols)"]),
    ("should a browser send the Referer header when following a link from an https page to a plain http URL",
     "2616", ["15.1"], ["SHOULD NOT include a Referer"]),
    ("which warn-code says a cached response is stale",
     "2616", ["14.46"], ["110 Response is stale"]),
    ("should a message parser accept a bare LF as the end of a header line",
     "2616", ["19.3"], ["single LF"]),
    ("which port is used when an http URL does not give one",
     "2616", ["3.2"], ["port 80 is assumed"]),
    ("when does the request line have to carry the full absolute URI instead of just the path",
     "2616", ["5.1"], ["absoluteURI form is REQUIRED"]),
    ("what must an origin server without a reliable clock avoid putting in its responses",
     "2616", ["14.18"], ["MUST NOT assign Expires"]),
    ("which response status codes may a cache store by default without explicit freshness info",
     "2616", ["13.4"], ["200, 203, 206, 300, 301"]),
    ("which responses never include a message body regardless of headers",
     "2616", ["4.3"], ["304 (not modified) responses"]),
    ("what is the fundamental difference between POST and PUT",
     "2616", ["9.6"], ["different meaning of the Request-URI"]),
    ("what media type is used for a response that carries several byte ranges at once",
     "2616", ["19.2", "14.16"], ["multipart/byteranges"]),
    ("what does a Vary value of asterisk tell a cache",
     "2616", ["14.44"], ["cannot determine from the request headers"]),
    ("how should recipients treat leading zeros in the HTTP version numbers",
     "2616", ["3.1"], ["MUST be ignored by recipients"]),

    # ---- RFC 3986 (URI generic syntax) ----
    ("which characters can always appear in a URI without percent-encoding",
     "3986", ["2.3"], ["\"-\" / \".\" / \"_\" / \"~\""]),
    ("should percent-encoded octets be written with upper or lower case hex digits",
     "3986", ["2.1"], ["uppercase hexadecimal digits"]),
    ("when comparing URIs is %3a the same as %3A",
     "3986", ["6.2"], ["case-insensitive"]),
    ("what is the canonical letter case of a URI scheme name",
     "3986", ["3.1"], ["lowercase"]),
    ("is the host part of a URI case sensitive",
     "3986", ["3.2", "6.2"], ["insensitive"]),
    ("how do you put an IPv6 address literal in a URI",
     "3986", ["3.2"], ["square brackets"]),
    ("should an http URI include the port when it is the default 80",
     "3986", ["3.2"], ["omit the port component"]),
    ("is the fragment part of a URI sent to the server when the URI is dereferenced",
     "3986", ["3.5"], ["solely by the user agent"]),
    ("can a query string contain unencoded slashes and question marks",
     "3986", ["3.4"], ["slash (\"/\") and question mark (\"?\")"]),
    ("what do you get when removing dot segments from /a/b/c/./../../g",
     "3986", ["5.2"], ["/a/g"]),
    ("what does the relative reference ../g resolve to against the base http://a/b/c/d;p?q",
     "3986", ["5.4"], ["http://a/b/g"]),
    ("what happens when a relative reference has more .. segments than the base path, like ../../../g",
     "3986", ["5.4"], ["http://a/g"]),
    ("if a document has no embedded base and no encapsulating entity, which base URI is used for relative references",
     "3986", ["5.1"], ["that URI shall be considered the base URI"]),
    ("is there a regular expression that splits a URI reference into its components",
     "3986", ["B"], ["^(([^:/?#]+):)?(//([^/?#]*))?([^?#]*)(\\?([^#]*))?(#(.*))?"]),
    ("what is the recommended way to delimit URIs that appear inside plain text",
     "3986", ["C"], ["angle brackets"]),
    ("which ABNF rule names the general delimiter characters in URIs",
     "3986", ["2.2"], ["gen-delims"]),
    ("is it safe to percent-decode the same string twice",
     "3986", ["2.4"], ["more than once"]),
    ("what character encoding should non-ASCII text be converted to before percent-encoding in a new URI scheme",
     "3986", ["2.5"], ["UTF-8"]),
    ("should new specifications say URL or URN",
     "3986", ["1.1"], ["general term \"URI\""]),
    ("if a URI has an authority component what must its path look like",
     "3986", ["3.3"], ["begin with a slash"]),
    ("how do I write a relative path reference whose first segment contains a colon",
     "3986", ["4.2"], ["./this:that"]),
    ("can simple character-by-character comparison say two equivalent URIs are different",
     "3986", ["6.2"], ["false negatives"]),
    ("during normalization what should happen to percent-encoded unreserved characters like %7E",
     "3986", ["6.2"], ["decoding any percent-encoded octet"]),
    ("what is the recommended maximum length for a registered host name in a URI",
     "3986", ["3.2"], ["255 characters"]),
    ("which earlier RFC introduced the IPv6 literal syntax that was folded into the generic URI syntax",
     "3986", ["D"], ["RFC2732"]),
    ("how does the URI grammar define each part of a dotted IPv4 address",
     "3986", ["3.2", "A"], ["dec-octet"]),
    ("can userinfo be abused to make a URI look like it points at a trusted site",
     "3986", ["7.6"], ["10.0.0.1"]),
    ("should a URI contain a password that is supposed to stay secret",
     "3986", ["7.5"], ["should not provide a URI"]),
    ("how does a backward-compatible parser resolve http:g against http://a/b/c/d;p?q",
     "3986", ["5.4"], ["http://a/b/c/g"]),
    ("when merging paths and the base has an authority but an empty path, what path is used",
     "3986", ["5.2"], ["consisting of \"/\" concatenated"]),
    ("does having a URI for something guarantee that the resource can be accessed",
     "3986", ["1.2"], ["neither guaranteed nor"]),
    ("should security checks on URI data run before or after percent-decoding",
     "3986", ["7.3"], ["should be applied after"]),
    ("how should an application handle a %00 percent-encoding it did not expect in a URI component",
     "3986", ["7.3"], ["should be rejected"]),
    ("what is the ABNF rule for URI-reference in the collected grammar",
     "3986", ["A", "4.1"], ["URI / relative-ref"]),
    ("which form of URI do protocol elements use when a fragment identifier is not allowed",
     "3986", ["4.3"], ["absolute-URI"]),

    # ---- RFC 6749 (OAuth 2.0) ----
    ("does the client have to include the state parameter when redirecting the user to the authorization endpoint",
     "6749", ["4.1"], ["RECOMMENDED"]),
    ("what is the recommended maximum lifetime of an authorization code",
     "6749", ["4.1"], ["10 minutes"]),
    ("what response_type does the implicit flow use",
     "6749", ["4.2"], ["set to \"token\""]),
    ("can the implicit grant return a refresh token",
     "6749", ["4.2"], ["MUST NOT issue a refresh token"]),
    ("where in the redirect does the access token appear in the implicit flow",
     "6749", ["4.2"], ["fragment component of the redirection URI"]),
    ("which HTTP method must a client use to call the token endpoint",
     "6749", ["3.2"], ["\"POST\" method"]),
    ("can the client send client_id and client_secret in the request body instead of HTTP Basic",
     "6749", ["2.3"], ["NOT RECOMMENDED"]),
    ("is a native mobile app a confidential or a public client",
     "6749", ["2.1"], ["public client"]),
    ("is a fragment allowed in a registered redirection URI",
     "6749", ["3.1"], ["MUST NOT include a fragment component"]),
    ("how are multiple scopes written in the scope parameter",
     "6749", ["3.3"], ["case-sensitive strings"]),
    ("what caching header must a successful token response carry",
     "6749", ["5.1"], ["\"no-store\""]),
    ("what unit is expires_in expressed in",
     "6749", ["5.1"], ["lifetime in seconds"]),
    ("which HTTP status do token endpoint error responses use by default",
     "6749", ["5.2"], ["400 (Bad Request)"]),
    ("which error code is returned when the authorization server does not support the requested grant type",
     "6749", ["5.2"], ["unsupported_grant_type"]),
    ("when a refresh returns a new refresh token what must happen to the old one",
     "6749", ["6"], ["MUST discard the old refresh token"]),
    ("can a refresh request ask for scopes beyond what was originally granted",
     "6749", ["6"], ["not originally granted"]),
    ("should the client credentials grant issue a refresh token",
     "6749", ["4.4"], ["SHOULD NOT be included"]),
    ("how is an extension grant identified in the grant_type parameter",
     "6749", ["4.5"], ["absolute URI"]),
    ("which TLS version was the most recent when OAuth 2.0 was published",
     "6749", ["1.6"], ["TLS version 1.2"]),
    ("why should native apps be careful about using an embedded browser for authorization",
     "6749", ["9"], ["making phishing attacks easier"]),
    ("what header can an authorization server use to stop its login page being framed for clickjacking",
     "6749", ["10.13"], ["X-Frame-Options"]),
    ("how unlikely must it be for an attacker to guess a generated token",
     "6749", ["10.10"], ["2^(-128)"]),
    ("how can an authorization server detect a stolen refresh token used by a public client",
     "6749", ["10.4"], ["rotation in which a new refresh token"]),
    ("what lifetime and usage properties should authorization codes have",
     "6749", ["10.5"], ["short lived and single-use"]),
    ("how long is the review period for registering a new OAuth parameter",
     "6749", ["11.2"], ["two-week review period"]),
    ("what characters are allowed in a client_id according to the ABNF appendix",
     "6749", ["A"], ["*VSCHAR"]),
    ("are refresh tokens ever sent to the resource server",
     "6749", ["1.5"], ["never sent"]),
    ("does the authorization endpoint have to accept GET requests",
     "6749", ["3.1"], ["MUST support the use of the HTTP \"GET\""]),
    ("if redirect_uri was in the authorization request does the token request need the same value",
     "6749", ["4.1"], ["MUST be identical"]),
    ("should the authorization server redirect back to the client when the redirect URI is invalid",
     "6749", ["4.1"], ["MUST NOT automatically redirect"]),
    ("what grant_type value does the resource owner password flow use",
     "6749", ["4.3"], ["set to \"password\""]),
    ("how should a client protect its redirection endpoint against CSRF",
     "6749", ["10.12"], ["\"state\" request parameter"]),
    ("why is the resource owner password credentials grant considered risky",
     "6749", ["10.7"], ["higher risk"]),
    ("which character encoding is used for form-encoded OAuth parameter values",
     "6749", ["B"], ["UTF-8"]),
    ("can an implicit-flow access token be used to prove who the user is to a public client",
     "6749", ["10.16"], ["impersonate the resource owner"]),
]

# Unanswerable: topics outside RFC 2616/3986/6749.  Each entry lists keywords
# that are checked (case-insensitive, word-boundary) to be absent from the corpus.
UNANSWERABLE = [
    ("what is the default SETTINGS_MAX_FRAME_SIZE for HTTP/2 frames", ["SETTINGS_MAX_FRAME_SIZE", "frame size"]),
    ("how does the HTTP/2 PUSH_PROMISE frame work for server push", ["PUSH_PROMISE", "server push"]),
    ("how does HPACK compress header fields", ["HPACK"]),
    ("what does SameSite=Lax do on a cookie", ["SameSite"]),
    ("does the HttpOnly cookie attribute prevent JavaScript from reading the cookie", ["HttpOnly"]),
    ("which claims are required in an OpenID Connect id_token", ["id_token", "OpenID"]),
    ("what is the minimum length of the PKCE code_verifier", ["code_verifier", "PKCE"]),
    ("how many round trips does the TLS 1.3 handshake take", ["TLS 1.3", "TLS version 1.3"]),
    ("what max-age should be used in the Strict-Transport-Security header", ["Strict-Transport-Security", "HSTS"]),
    ("when does a browser send a CORS preflight request", ["preflight", "Access-Control-Allow-Origin"]),
    ("which UDP port and transport does HTTP/3 over QUIC use", ["QUIC", "HTTP/3"]),
    ("how is the Sec-WebSocket-Key header validated during the WebSocket handshake", ["WebSocket", "Sec-WebSocket-Key"]),
    ("what does the 451 Unavailable For Legal Reasons status code mean", ["451", "Legal Reasons"]),
    ("is the alg none header allowed in a JWT access token", ["JWT", "JSON Web Token"]),
    ("how does a resource server call the OAuth token introspection endpoint", ["introspection"]),
    ("what does the device authorization grant return as device_code and user_code", ["device_code", "user_code"]),
    ("what goes in the software_statement of OAuth dynamic client registration", ["software_statement"]),
    ("what is the content-coding token for Brotli compression", ["Brotli"]),
    ("how does a client ask for a minimal response body with the Prefer header", ["Prefer header", "return=minimal"]),
    ("how does a DPoP proof bind an access token to a key", ["DPoP"]),
    ("which Content-Security-Policy directive restricts script sources", ["Content-Security-Policy"]),
    ("what is the ALPN protocol identifier for HTTP/2 over TLS", ["ALPN", "h2"]),
    ("how is the X-Forwarded-For header formatted by proxies", ["X-Forwarded-For", "Forwarded header"]),
    ("when should a server send 103 Early Hints", ["Early Hints", "103"]),
    ("how are certificate-bound access tokens validated with mutual TLS", ["certificate-bound", "mTLS", "mutual TLS"]),
]


def kw_present(keyword, texts):
    pat = re.compile(r"(?<![A-Za-z0-9])" + re.escape(keyword) + r"(?![A-Za-z0-9])", re.I)
    return [pid for pid, t in texts if pat.search(t)]


def main():
    docs, sec2doc = build_corpus()
    by_id = {d["_id"]: d for d in docs}
    problems = []

    queries, qrels, answers = [], [], []
    n = 0
    for text, rfc, secs, ans in ANSWERABLE:
        n += 1
        qid = f"r{n:03d}"
        golds = []
        for s in secs:
            pid = doc_for(sec2doc, rfc, s)
            if pid not in golds:
                golds.append(pid)
        queries.append({"_id": qid, "text": text, "metadata": {"answerable": True}})
        for g in golds:
            qrels.append((qid, g, 1))
        answers.append({"query-id": qid, "answerable": True, "gold_doc": golds[0], "answers": ans})
    all_texts = [(d["_id"], d["title"] + "\n" + d["text"]) for d in docs]
    for text, kws in UNANSWERABLE:
        n += 1
        qid = f"r{n:03d}"
        queries.append({"_id": qid, "text": text, "metadata": {"answerable": False}})
        answers.append({"query-id": qid, "answerable": False, "gold_doc": None, "answers": []})
        for kw in kws:
            hits = kw_present(kw, all_texts)
            if hits:
                problems.append(f"{qid}: unanswerable keyword {kw!r} found in {hits[:3]}")

    # ---- verification ----
    ids = [d["_id"] for d in docs]
    if len(ids) != len(set(ids)):
        problems.append("duplicate corpus ids")
    qids = [q["_id"] for q in queries]
    if len(qids) != len(set(qids)):
        problems.append("duplicate query ids")
    if len(set(q["text"].lower() for q in queries)) != len(queries):
        problems.append("duplicate query texts")
    for qid, pid, _ in qrels:
        if pid not in by_id:
            problems.append(f"{qid}: qrel doc {pid} missing")
    per_q = {}
    for qid, pid, _ in qrels:
        per_q.setdefault(qid, []).append(pid)
    for a in answers:
        if not a["answerable"]:
            if a["query-id"] in per_q:
                problems.append(f"{a['query-id']}: unanswerable query has qrels")
            continue
        if not 1 <= len(per_q.get(a["query-id"], [])) <= 2:
            problems.append(f"{a['query-id']}: needs 1-2 gold passages")
        gold = by_id.get(a["gold_doc"], {}).get("text", "").lower()
        for s in a["answers"]:
            if not 1 <= len(s.split()) <= 8:
                problems.append(f"{a['query-id']}: answer {s!r} not 1-8 words")
            if s.lower() not in gold:
                problems.append(f"{a['query-id']}: answer {s!r} not in {a['gold_doc']}")
    for d in docs:
        if re.search(r"[^\x00-\x7f]", d["text"]):
            problems.append(f"{d['_id']}: non-ASCII text left in passage")
        if len(d["text"]) < MIN_CHARS:
            problems.append(f"{d['_id']}: shorter than {MIN_CHARS} chars")

    if "--check" not in sys.argv:
        with open(os.path.join(OUT, "corpus.jsonl"), "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"_id": d["_id"], "title": d["title"], "text": d["text"]},
                                   ensure_ascii=False) + "\n")
        with open(os.path.join(OUT, "queries.jsonl"), "w", encoding="utf-8") as f:
            for q in queries:
                f.write(json.dumps(q, ensure_ascii=False) + "\n")
        os.makedirs(os.path.join(OUT, "qrels"), exist_ok=True)
        with open(os.path.join(OUT, "qrels", "test.tsv"), "w", encoding="utf-8") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            for qid, pid, sc in qrels:
                f.write(f"{qid}\t{pid}\t{sc}\n")
        with open(os.path.join(OUT, "answers.jsonl"), "w", encoding="utf-8") as f:
            for a in answers:
                f.write(json.dumps(a, ensure_ascii=False) + "\n")

    lens = [len(d["text"]) for d in docs]
    n_ans = sum(1 for q in queries if q["metadata"]["answerable"])
    per_rfc = {r: sum(1 for x in ANSWERABLE if x[1] == r) for r in RFCS}
    print(f"passages: {len(docs)}  mean length: {sum(lens) / len(lens):.0f} chars "
          f"(min {min(lens)}, max {max(lens)})")
    print(f"queries: {len(queries)}  answerable: {n_ans} {per_rfc}  unanswerable: {len(queries) - n_ans}")
    print(f"qrels rows: {len(qrels)}  gold passages used: {len(set(p for _, p, _ in qrels))}")
    print("problems:" if problems else "problems: none")
    for p in problems:
        print("  -", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
